"""Grouped GEMM for a diagonal step: row group g multiplies by layer weight first_layer + g."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import Backend, resolve_backend
from pallas_kernels.grouped_matmul_kernel import grouped_matmul_pallas

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def grouped_matmul_reference(
    x: jax.Array,
    w: jax.Array,
    first_layer: jax.Array | int,
    num_active: jax.Array | int,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """Plain-jnp oracle: y[g] = x[g] @ w[first_layer + g] for g < num_active, else 0 (fp32 accumulation,
    returned in `out_dtype`, default x.dtype)."""
    num_groups, num_layers = x.shape[0], w.shape[0]
    groups = jnp.arange(num_groups, dtype=jnp.int32)
    layers = jnp.clip(jnp.asarray(first_layer, jnp.int32) + groups, 0, num_layers - 1)  # [G]
    w_g = jnp.take(w, layers, axis=0)  # [G K N]
    y = jnp.einsum(
        "gtk,gkn->gtn", x, w_g, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
    )  # [G T N]; no TF32 on GPU: this is the oracle
    active = groups < jnp.asarray(num_active, jnp.int32)  # [G]
    return jnp.where(active[:, None, None], y, 0.0).astype(out_dtype or x.dtype)


def _check_inputs(
    x: jax.Array, w: jax.Array, first_layer: jax.Array | int, num_active: jax.Array | int
) -> None:
    """Raise ValueError naming the tensor for bad shapes or dtypes."""
    if x.ndim != 3:
        raise ValueError(f"grouped_matmul: x must be [G, T, K], got shape {x.shape}")
    if w.ndim != 3:
        raise ValueError(f"grouped_matmul: w must be [L, K, N], got shape {w.shape}")
    if x.shape[2] != w.shape[1]:
        raise ValueError(
            f"grouped_matmul: contraction mismatch, x {x.shape} (K={x.shape[2]}) "
            f"vs w {w.shape} (K={w.shape[1]})"
        )
    for name, arr in (("x", x), ("w", w)):
        if jnp.dtype(arr.dtype) not in _FLOAT_DTYPES:
            raise ValueError(f"grouped_matmul: {name} must be float32 or bfloat16, got {arr.dtype}")
    for name, s in (("first_layer", first_layer), ("num_active", num_active)):
        s = jnp.asarray(s)
        if s.ndim != 0 or not jnp.issubdtype(s.dtype, jnp.integer):
            raise ValueError(
                f"grouped_matmul: {name} must be an integer scalar, got {s.dtype}{list(s.shape)}"
            )
    if isinstance(first_layer, int) and isinstance(
        num_active, int
    ):  # traced values are the caller's contract
        num_groups, num_layers = x.shape[0], w.shape[0]
        if not (
            first_layer >= 0 and 0 <= num_active <= num_groups and first_layer + num_active <= num_layers
        ):
            raise ValueError(
                f"grouped_matmul: need 0 <= first_layer, 0 <= num_active <= G={num_groups} and "
                f"first_layer + num_active <= L={num_layers}; got first_layer={first_layer}, "
                f"num_active={num_active}"
            )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped_matmul_pallas_vjp(
    x: jax.Array,
    w: jax.Array,
    first_layer: jax.Array,
    num_active: jax.Array,
    out_dtype: jnp.dtype,
    interpret: bool,
) -> jax.Array:
    """Pallas forward with a Pallas backward (dx on transposed weights, dw per group)."""
    return grouped_matmul_pallas(x, w, first_layer, num_active, out_dtype=out_dtype, interpret=interpret)


def _fwd(
    x: jax.Array,
    w: jax.Array,
    first_layer: jax.Array,
    num_active: jax.Array,
    out_dtype: jnp.dtype,
    interpret: bool,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    y = grouped_matmul_pallas(x, w, first_layer, num_active, out_dtype=out_dtype, interpret=interpret)
    return y, (x, w, first_layer, num_active)


def _bwd(
    out_dtype: jnp.dtype, interpret: bool, residuals: tuple[jax.Array, ...], dy: jax.Array
) -> tuple[jax.Array | None, ...]:
    x, w, first_layer, num_active = residuals
    # dx[g] = dy[g] @ w[first + g]^T: same kernel, weights read transposed in-kernel.
    dx = grouped_matmul_pallas(
        dy, w, first_layer, num_active, trans_b=True, out_dtype=x.dtype, interpret=interpret
    )  # [G T K]
    # dw_g[g] = x[g]^T @ dy[g]: same kernel, lhs read transposed, "layers" are the groups of dy.
    dw_g = grouped_matmul_pallas(
        x, dy, 0, num_active, trans_a=True, out_dtype=w.dtype, interpret=interpret
    )  # [G K N], fp32-accumulated in-kernel
    layers = first_layer + jnp.arange(x.shape[0], dtype=jnp.int32)  # each layer touched at most once
    dw = jnp.zeros(w.shape, w.dtype).at[layers].add(dw_g, mode="drop")  # [L K N]
    return dx, dw, None, None


_grouped_matmul_pallas_vjp.defvjp(_fwd, _bwd)


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    first_layer: jax.Array | int,
    num_active: jax.Array | int,
    *,
    backend: Backend = "auto",
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """y[g] = x[g] @ w[first_layer + g] for g < num_active (zero rows after); x [G T K], w [L K N] -> [G T N]
    in `out_dtype` (default x.dtype; accumulation is fp32 either way)."""
    resolved = resolve_backend(backend)
    _check_inputs(x, w, first_layer, num_active)
    first_layer = jnp.asarray(first_layer, jnp.int32)
    num_active = jnp.asarray(num_active, jnp.int32)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"grouped_matmul: out_dtype must be float32 or bfloat16, got {out_dtype}")
    if resolved == "xla":
        return grouped_matmul_reference(x, w, first_layer, num_active, out_dtype)
    return _grouped_matmul_pallas_vjp(x, w, first_layer, num_active, out_dtype, resolved == "interpret")
