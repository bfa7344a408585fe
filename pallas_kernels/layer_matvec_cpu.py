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
import numpy as np

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
    return layer_matvecs(x, (weights,), layer, transposed)[0]


def layer_matvecs(
    x: jax.Array,
    weights: tuple[jax.Array, ...],
    layer: jax.Array | int,
    transposed: bool = False,
    norm: tuple[jax.Array, float] | None = None,
) -> tuple[jax.Array, ...]:
    """`layer_matvec` of one input by several weight stacks (one dtype), in one call: `(x @ w[layer], ...)`.

    With `norm = (gain [K], eps)` the input is first RMS-normalised in the kernel, as `rms_norm` below
    (the model's norm): `(rms_norm(x, gain, eps) @ w[layer], ...)`.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"layer_matvec: the native CPU kernel is unavailable: {error}")
    k = x.shape[-1]
    for w in weights:
        if w.ndim != 3 or w.dtype not in (jnp.float32, jnp.bfloat16) or w.dtype != weights[0].dtype:
            raise ValueError(
                f"layer_matvec: weights must be float32/bfloat16 [L, K, N] of one dtype, got {w.dtype}{w.shape}"
            )
        wk = w.shape[2] if transposed else w.shape[1]
        if wk != k:
            raise ValueError(f"layer_matvec: x has {k} features, the weights {wk}")
    gain, eps = (jnp.zeros((0,), x.dtype), 0.0) if norm is None else norm
    if norm is not None and (gain.shape != (k,) or gain.dtype not in (jnp.float32, jnp.bfloat16)):
        raise ValueError(
            f"layer_matvec: the norm gain must be float32/bfloat16 [{k}], got {gain.dtype}{gain.shape}"
        )
    return _products(x, gain, tuple(weights), jnp.asarray(layer, jnp.int32), transposed, float(eps))


def rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to x's dtype before the gain (the kernel's prologue, and the model's
    norm `jaxlongctx.model.layers.rms_norm`)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return gain * xf.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _products(
    x: jax.Array,
    gain: jax.Array,
    weights: tuple[jax.Array, ...],
    layer: jax.Array,
    transposed: bool,
    eps: float,
):
    """The kernel call (normalising x first where `gain` is not empty), differentiable: its gradients are
    XLA's (training through a head or a decode step over few rows, e.g. a small batch's last tokens)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).astype(jnp.float32)
    widths = [w.shape[1] if transposed else w.shape[2] for w in weights]
    shapes = tuple(jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32) for n in widths)
    call = jax.ffi.ffi_call(TARGET, shapes, vmap_method="sequential")
    ys = call(
        rows,
        layer,
        gain,
        *weights,
        transposed=transposed,
        eps=np.float32(eps),
        round_bf16=bool(x.dtype == jnp.bfloat16),
    )
    return tuple(y.reshape(*x.shape[:-1], n).astype(x.dtype) for y, n in zip(ys, widths))


def _products_fwd(x, gain, weights, layer, transposed, eps):
    return _products(x, gain, weights, layer, transposed, eps), (x, gain, weights, layer)


def _products_bwd(transposed, eps, residuals, grads):
    """Through XLA: the norm's gradient by `jax.vjp`; dx = sum_i dy_i @ w_i[layer]^T; dw_i is zero but at
    `layer`, where it is x^T dy_i."""
    x, gain, weights, layer = residuals
    if gain.size:
        normed, norm_vjp = jax.vjp(lambda x, g: rms_norm(x, g, eps), x, gain)
    else:
        normed = x
    rows = normed.reshape(-1, x.shape[-1]).astype(jnp.float32)
    dx = jnp.zeros_like(rows)
    dweights = []
    for w, g in zip(weights, grads):
        dy = g.reshape(rows.shape[0], -1).astype(jnp.float32)
        wl = jax.lax.dynamic_index_in_dim(w, layer, keepdims=False).astype(jnp.float32)  # [K N] or [N K]
        dx = dx + (dy @ wl if transposed else dy @ wl.T)
        dwl = dy.T @ rows if transposed else rows.T @ dy
        dweights.append(jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(w), dwl.astype(w.dtype), layer, 0))
    dx = dx.reshape(x.shape).astype(normed.dtype)
    dx, dgain = norm_vjp(dx) if gain.size else (dx, jnp.zeros_like(gain))
    float0 = np.zeros(np.shape(layer), jax.dtypes.float0)
    return dx.astype(x.dtype), dgain, tuple(dweights), float0


_products.defvjp(_products_fwd, _products_bwd)
