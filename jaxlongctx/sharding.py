"""Sharding rules and the low-level helpers every model module uses on an explicit-axis mesh.

One table (`LOGICAL_AXES`) maps the logical axes of parameters, KV caches and activations to
mesh axes. Column-parallel weights (q/k/v by heads, MLP gate/up, LM head by vocabulary) are
split along their output, row-parallel ones (attention output, MLP down) along their input; the
row-parallel contractions name their output sharding (`matmul`), which makes XLA
insert one all-reduce per column/row pair. The embedding is vocab-parallel (`embed_lookup`); a
vocabulary that does not divide by tp is replicated instead. `shard_map` appears only around the
Pallas PQ kernel. Everything here is a no-op for unsharded (single-device) arrays.

More devices than kv heads (tp = K * R): `jaxlongctx.parallel.fit_mesh` splits the tensor axis into
`tp` (K device groups, one per kv head) and `kv_rep` (the R devices of a group). Every tensor-parallel
axis is then split over both, except the kv heads (k/v weights and caches), which are split over `tp`
only: each kv head is replicated on the R devices whose query heads read it, as vLLM does.

Placing whole models on a mesh (building meshes, parameter shardings) is `jaxlongctx.parallel`, which
sits above the model modules; this module sits below them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, TENSOR = "dp", "tp"  # mesh axis names

KV_REPLICA = "kv_rep"  # the devices sharing one kv head, when tp exceeds the kv heads (see `fit_mesh`)

# Logical axis -> mesh axis (None = replicated). The only place sharding decisions are made.
LOGICAL_AXES: dict[str, str | None] = {
    "batch": DATA,
    "vocab": TENSOR,
    "embed": None,
    "q_heads": TENSOR,
    "kv_heads": TENSOR,
    "mlp": TENSOR,
    "layers": None,
    "head_dim": None,
    "seq": None,
    "mem_value": TENSOR,  # the value (model-width) axis of ARMT's W_mv and memory state A
}

# Logical axes of every parameter, by leaf name (per-layer leaves lead with "layers").
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "input_norm": ("layers", "embed"),
    "post_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "q_heads"),
    "wk": ("layers", "embed", "kv_heads"),
    "wv": ("layers", "embed", "kv_heads"),
    "wo": ("layers", "q_heads", "embed"),
    "bq": ("layers", "q_heads"),
    "bk": ("layers", "kv_heads"),
    "bv": ("layers", "kv_heads"),
    "bo": ("layers", "embed"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
}

CACHE_AXES = ("layers", "batch", "kv_heads", "seq", "head_dim")  # DenseCache k/v [L, B, K, S, hd]

# ARMT memory parameters (`MemoryParams`) by leaf name, and the memory state A [L, B, dk, D], z [L, B, dk].
# W_mv is column parallel: each device holds the value columns (and the columns of A) of its shard,
# the delta-rule write is local to them, and the read gathers the D columns once per layer.
MEMORY_PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "memory": (None, "embed"),
    "sink": (None, "embed"),
    "wq": ("layers", "embed", None),
    "wk": ("layers", "embed", None),
    "wv": ("layers", "embed", "mem_value"),
    "wb": ("layers", "embed"),
    "bb": ("layers",),
}

MEMORY_STATE_AXES = {
    "A": ("layers", "batch", None, "mem_value"),
    "z": ("layers", "batch", None),
    "wk": ("layers", "batch", None, "kv_heads", None),  # sliding window [L, B, S, K, hd], like the KV cache
    "wv": ("layers", "batch", None, "kv_heads", None),
    "wn": ("layers", "batch"),
}


def tensor_size(mesh: Mesh) -> int:
    """The tensor-parallel degree tp of a mesh (its `tp` axis times its `kv_rep` axis, if any)."""
    return mesh.shape[TENSOR] * dict(mesh.shape).get(KV_REPLICA, 1)


def logical_spec(
    axes: tuple[str | None, ...], rows: str | None = LOGICAL_AXES["batch"], mesh: Mesh | None = None
) -> P:
    """The `PartitionSpec` of logical axes under `LOGICAL_AXES`, the batch axis mapped to `rows`
    (e.g. None where dp does not divide the batch). On a `mesh` with a `kv_rep` axis, tensor-parallel
    axes other than the kv heads are split over (`tp`, `kv_rep`)."""
    replicas = mesh is not None and KV_REPLICA in mesh.axis_names

    def mesh_axes(a: str | None) -> Any:
        if a is None:
            return None
        if a == "batch":
            return rows
        if replicas and LOGICAL_AXES[a] == TENSOR and a != "kv_heads":
            return (TENSOR, KV_REPLICA)
        return LOGICAL_AXES[a]

    return P(*(mesh_axes(a) for a in axes))


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """Place a host or device array with `sharding`; works when the mesh spans several processes."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def memory_state_shardings(mesh: Mesh, batch: int) -> dict[str, NamedSharding]:
    """Shardings of the ARMT memory state `{"A": ..., "z": ...}` for `batch` rows (split over dp when
    it divides the batch) with A's value columns over tp."""
    rows = batch_sharding(mesh, (batch,)).spec[0]
    return {
        name: NamedSharding(mesh, logical_spec(axes, rows, mesh)) for name, axes in MEMORY_STATE_AXES.items()
    }


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh the leaves of a (parameter) pytree are sharded on, or None if they are not."""
    leaves = jax.tree.leaves(tree)
    sharding = getattr(leaves[0], "sharding", None) if leaves else None
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def batch_sharding(mesh: Mesh, shape: tuple[int, ...], axis: int = 0) -> NamedSharding:
    """Activations with their batch at `axis` split over the data axis (replicated if dp is 1 or does
    not divide the batch; a size-1 batch dim on a size-1 axis loses its sharding in some JAX ops)."""
    split = mesh.shape[DATA] > 1 and shape[axis] % mesh.shape[DATA] == 0
    spec = [None] * len(shape)
    spec[axis] = LOGICAL_AXES["batch"] if split else None
    return NamedSharding(mesh, P(*spec))


def put_batch(x: Any, mesh: Mesh | None, axis: int = 0) -> jax.Array:
    """An input with its batch at `axis` on device: plain `jnp.asarray` without a mesh, else split over `dp`."""
    if mesh is None:
        return jnp.asarray(x)
    return put(np.asarray(x), batch_sharding(mesh, np.shape(x), axis))


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of dense KV cache buffers `[L, B, K, S, hd]`: batch over dp, kv heads over tp."""
    return NamedSharding(mesh, logical_spec(CACHE_AXES))


def sharding_like(like: jax.Array) -> NamedSharding | None:
    """`out_sharding` that lays a contraction's output out like `like` (e.g. the residual stream:
    batch split, features whole), so row-parallel products all-reduce; None when `like` is not on a mesh."""
    sharding = jax.typeof(like).sharding
    return None if sharding.mesh.empty else sharding


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x [..., in] @ w [in, out]`. When `in` is split over a mesh axis (a row-parallel product) the
    partial sums are all-reduced: the output keeps x's leading layout and takes w's `out` layout."""
    x_type = jax.typeof(x)
    if x_type.sharding.mesh.empty or x_type.sharding.spec[-1] is None:
        return x @ w
    spec = (*x_type.sharding.spec[:-1], jax.typeof(w).sharding.spec[-1])
    return jnp.matmul(x, w, out_sharding=NamedSharding(x_type.sharding.mesh, P(*spec)))


def reshard_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` moved to the layout of `like` (same rank), e.g. vocab-split logits gathered; no-op off a mesh."""
    sharding = sharding_like(like)
    return x if sharding is None else jax.sharding.reshard(x, sharding)


def embed_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of `table [V, D]` for `ids [B, T]` -> `[B, T, D]`. With the vocabulary split over tp, XLA
    partitions the gather vocab-parallel: each shard looks up the ids in its range, the others give
    zeros, and one all-reduce sums them; the output is laid out like `ids` (batch over dp)."""
    sharding = jax.typeof(table).sharding
    if sharding.mesh.empty:
        return jnp.take(table, ids, axis=0)
    out = NamedSharding(sharding.mesh, P(*jax.typeof(ids).sharding.spec, None))
    return table.at[ids].get(out_sharding=out)


def mesh_of_arrays(*args: Any) -> Mesh | None:
    """The mesh the array leaves of `args` live on (traced or concrete), or None when none is on a mesh."""
    for leaf in jax.tree.leaves(args):
        mesh = jax.typeof(leaf).sharding.mesh
        if not mesh.empty:
            return mesh
    return None


def per_kv_shard(fn: Callable[..., Any], out_specs: Any, *args: Any) -> Any:
    """`fn(*args)` run on each device's own (batch rows, kv heads) shard when `args` are on a mesh.

    For work that is local to a batch row and a kv head (PQ encoding, cache updates), so no
    communication is needed: the inputs keep their shardings (their specs are the in_specs) and
    `out_specs` (a pytree of `PartitionSpec`s) says how the results are laid out. Off a mesh this
    is a plain call."""
    mesh = mesh_of_arrays(*args)
    if mesh is None:
        return fn(*args)
    in_specs = jax.tree.map(lambda a: jax.typeof(a).sharding.spec, args)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)


def _kv_axes(q_heads: Any) -> Any:
    """The mesh axes of the kv heads that go with query heads split over `q_heads` (kv heads are not
    split over `kv_rep`)."""
    if not isinstance(q_heads, tuple):
        return q_heads
    rest = tuple(a for a in q_heads if a != KV_REPLICA)
    return rest[0] if len(rest) == 1 else (rest or None)


def sharded_pq_decode_attention(
    q: jax.Array,
    k_codes: jax.Array,
    v_codes: jax.Array,
    k_cent: jax.Array,
    v_cent: jax.Array,
    lengths: jax.Array,
    k_res: jax.Array,
    v_res: jax.Array,
    res_lengths: jax.Array,
    scale: float,
    *,
    backend: str = "auto",
    layer: jax.Array | None = None,
) -> jax.Array:
    """`pallas_kernels.pq_decode_attention` run per shard under `shard_map` when its inputs are on a
    mesh (codes and windows split over kv heads and batch, queries by the matching heads): attention
    is local to a kv-head group, so no communication is needed. Shapes as the kernel; -> `[B, H, D]`.
    With `layer` the codes are every layer's `[L, B, K, T, M]` (read in place off a mesh)."""
    from pallas_kernels import pq_decode_attention

    q_sharding = jax.typeof(q).sharding
    if q_sharding.mesh.empty:
        args = (q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, res_lengths)
        return pq_decode_attention(*args, scale, backend=backend, layer=layer)
    if layer is not None:
        k_codes, v_codes = (
            jax.lax.dynamic_index_in_dim(c, layer, keepdims=False) for c in (k_codes, v_codes)
        )
    args = (q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, res_lengths)
    kernel = lambda *a: pq_decode_attention(*a, scale, backend=backend)
    specs = tuple(jax.typeof(a).sharding.spec for a in args)
    batch, heads = specs[0][0], specs[0][1]
    kv_heads = _kv_axes(heads)  # a device's query heads all read the kv head(s) it holds
    expected = {
        "k_codes": (1, 1, kv_heads),
        "v_codes": (2, 1, kv_heads),
        "k_res": (6, 1, kv_heads),
        "v_res": (7, 1, kv_heads),
        "lengths": (5, 0, batch),
        "res_lengths": (8, 0, batch),
    }
    if k_cent.ndim == 4:
        expected.update({"k_cent": (3, 0, kv_heads), "v_cent": (4, 0, kv_heads)})
    for name, (i, dim, axis) in expected.items():
        if specs[i][dim] != axis:
            raise ValueError(
                f"sharded_pq_decode_attention: {name} dim {dim} is sharded {specs[i][dim]!r}, but "
                f"q's {'batch' if dim == 0 else 'heads'} need {axis!r}"
            )
    # check_vma=False: pallas_call outputs carry no varying-axes types; nothing here communicates
    return jax.shard_map(
        kernel, mesh=q_sharding.mesh, in_specs=specs, out_specs=P(batch, heads, None), check_vma=False
    )(*args)
