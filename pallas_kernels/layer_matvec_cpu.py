"""Few-row products against one layer of stacked weights, read in place: a C++ XLA FFI kernel for CPU.

A decode step is bound by reading the weights: every matrix of the model is multiplied by one row per
sequence. XLA's CPU dot copies each layer's slice out of the stacked `[L, in, out]` weights inside the
layer scan, and widens bf16 weights to float32 through memory before multiplying, so a step reads
(and writes) the weights several times. `layer_matvec_cpu.cc` multiplies `x [M, K]` by layer `layer`
of the stack where it lies, widening bf16 in registers, on XLA's intra-op threads. It is built on
first use (`pallas_kernels.native_build`); `native_kernel_error()` says why when it cannot be.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import native_build

SOURCE = Path(__file__).with_name("layer_matvec_cpu.cc")
TARGET = "jaxlongctx_layer_matvec"
MAX_ROWS = 16  # more rows than this are a GEMM: XLA's dot is the better program


@functools.cache
def native_kernel_error() -> str | None:
    """Build and register the CPU kernel once per process; None on success, else why it is unavailable."""
    return native_build.build_and_register(SOURCE, "LayerMatvec", TARGET)


def layer_matvec(
    x: jax.Array, weights: jax.Array, layer: jax.Array | int, transposed: bool = False
) -> jax.Array:
    """`x [..., K] @ weights[layer]` in float32, cast to x's dtype: `[..., N]`.

    weights: float32 or bfloat16 `[L, K, N]` (`[L, N, K]` with `transposed`, whose rows are contracted
    with x, as a tied embedding is), read in place; layer: a scalar int (traced is fine). Products of
    each output accumulate in float32 over K.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"layer_matvec: the native CPU kernel is unavailable: {error}")
    if weights.ndim != 3 or weights.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(
            f"layer_matvec: weights must be float32/bfloat16 [L, K, N], got {weights.dtype}{weights.shape}"
        )
    n, k = (weights.shape[1], weights.shape[2]) if transposed else (weights.shape[2], weights.shape[1])
    if x.shape[-1] != k:
        raise ValueError(f"layer_matvec: x has {x.shape[-1]} features, the weights {k}")
    rows = x.reshape(-1, k).astype(jnp.float32)
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32), vmap_method="sequential"
    )
    y = call(rows, weights, jnp.asarray(layer, jnp.int32), transposed=transposed)
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)
