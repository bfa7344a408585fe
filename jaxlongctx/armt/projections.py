"""How a diagonal step multiplies its cells by the stacked layer weights (spec 2: "linear layers become
a batched or grouped GEMM").

- "vmap": one `jax.vmap` of the single-layer cell over the window `[a, b)` of the stacked weights
  (XLA slices, i.e. copies, the window of every weight matrix first; runs anywhere, shards on a mesh).
- "grouped_matmul": every projection of the step (q, k, v, o, MLP gate/up/down and the memory
  projections W_mq, W_mk, W_mv, W_mb) is one `pallas_kernels.grouped_matmul` over the `G = b - a`
  active layers: row group g is multiplied by layer `a + g` of the stacked weights `[L, in, out]`,
  read in place (no weight copy); only the small per-layer vectors (norms, biases) are sliced.
  Everything between the products (norms, RoPE, attention, memory read/write) runs on `[G, B, ...]`.

"auto" resolves to grouped_matmul where the kernel backend resolves to Pallas (a GPU) and the model
is on one device, to vmap elsewhere. Both give the sequential schedule's results.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlongctx.armt.memory import MemoryWeights, Project
from jaxlongctx.model.layers import DecoderLayer, Dense
from pallas_kernels.dispatch import BACKENDS, resolve_backend

PROJECTIONS = ("auto", "vmap", "grouped_matmul")


@dataclasses.dataclass(frozen=True)
class DiagonalProjections:
    """The projection method of a diagonal step (`PROJECTIONS`) and the pallas_kernels backend of
    grouped_matmul ("auto": Pallas on GPU, else the XLA reference; "interpret": the Pallas kernel
    interpreted on CPU, for tests)."""

    method: str = "auto"
    kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in PROJECTIONS:
            raise ValueError(
                f"diagonal projections must be one of {', '.join(PROJECTIONS)}, got {self.method!r}"
            )
        if self.kernel not in BACKENDS:
            raise ValueError(
                f"grouped_matmul kernel backend must be one of {', '.join(BACKENDS)}, got {self.kernel!r}"
            )

    def resolve(self, on_mesh: bool) -> str:
        """ "vmap" or "grouped_matmul" for a model on a mesh (`on_mesh`) or on one device."""
        if self.method == "auto":
            return "grouped_matmul" if resolve_backend(self.kernel) == "pallas" and not on_mesh else "vmap"
        if self.method == "grouped_matmul" and on_mesh:
            raise ValueError(
                "diagonal projections 'grouped_matmul' run on one device only; use 'vmap' (or 'auto') "
                "for a model on a mesh"
            )
        return self.method


def as_projections(value: DiagonalProjections | str) -> DiagonalProjections:
    """A `DiagonalProjections` from itself or a method name (kernel backend "auto")."""
    return value if isinstance(value, DiagonalProjections) else DiagonalProjections(value)


def grouped_products(first: int, groups: int, kernel: str) -> tuple[Dense, Project]:
    """The layer's and the memory weights' products for layers `[first, first + groups)`: x `[G, ..., in]`
    times stacked weights `[L, in, out]` -> `[G, ..., out]` (the layer's in x's dtype, the memory's in
    float32)."""
    from pallas_kernels import grouped_matmul

    def product(x: jnp.ndarray, w: jnp.ndarray, out_dtype: Any) -> jnp.ndarray:
        y = grouped_matmul(
            x.reshape(groups, -1, x.shape[-1]), w, first, groups, backend=kernel, out_dtype=out_dtype
        )
        return y.reshape(*x.shape[:-1], w.shape[-1])

    return (lambda x, w: product(x, w, x.dtype)), (lambda x, w: product(x, w, jnp.float32))


def grouped_weights(
    graphdef: nnx.GraphDef, layer_state: Any, memory_weights: MemoryWeights, a: int, b: int
) -> tuple[DecoderLayer, MemoryWeights]:
    """Layers `[a, b)` as one layer and one set of memory weights with a leading group axis: the weight
    matrices stay the whole stacked `[L, in, out]` arrays (read in place by the kernel), per-layer vectors
    are sliced `[G, X]`."""
    window = lambda w: w if w.ndim == 3 else w[a:b]
    layer = nnx.merge(graphdef, jax.tree.map(window, layer_state))
    return layer, memory_weights._replace(bb=memory_weights.bb[a:b])
