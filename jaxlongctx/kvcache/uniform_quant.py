"""KIVI-style uniform asymmetric fake quantization of K/V (the baseline PQ is compared against).

Keys are quantized per channel (each channel's values in groups of `group` tokens along T),
values per token (each token's values in groups of `group` channels along D). A group gets
zero = min, scale = (max - min) / (2**bits - 1), q = clip(round((x - zero) / scale)), both
scale and zero stored in fp16 (as a real cache would), so
    effective bits per element = bits + 2 * 16 / group
e.g. group 32: int2 -> 3, int4 -> 5, int8 -> 9. A trailing partial group uses the min/max of
its own elements only. `scale_dtype=jnp.float32` gives the ideal bound |x - q(x)| <= scale / 2;
fp16 adds its own rounding of scale and zero (and overflows above 65504).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

SUPPORTED_BITS = (2, 4, 8)
SCALE_BITS = 16  # fp16 scale and fp16 zero point per group


def effective_bits(bits: int, group: int = 32) -> float:
    """Stored bits per element: the code plus the group's fp16 scale and zero point."""
    _check(bits, group)
    return bits + 2 * SCALE_BITS / group


def _check(bits: int, group: int) -> None:
    """Validate bits and group size."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")


@partial(jax.jit, static_argnames=("bits", "group", "scale_dtype"))
def _quantize_last_axis(x: jax.Array, bits: int, group: int, scale_dtype: DTypeLike) -> jax.Array:
    """Fake-quantize x[..., A] in groups of `group` consecutive elements of the last axis."""
    a = x.shape[-1]
    groups = -(-a // group)
    xf = x.astype(jnp.float32)
    # Edge padding repeats the last element, so a partial group's min/max are its own.
    padded = jnp.pad(xf, [(0, 0)] * (x.ndim - 1) + [(0, groups * group - a)], mode="edge")
    g = padded.reshape(*x.shape[:-1], groups, group)
    lo = jnp.min(g, axis=-1, keepdims=True).astype(scale_dtype).astype(jnp.float32)
    hi = jnp.max(g, axis=-1, keepdims=True)
    levels = 2**bits - 1
    scale = ((hi - lo) / levels).astype(scale_dtype).astype(jnp.float32)
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round((g - lo) / safe), 0, levels)
    out = jnp.where(scale > 0, q * scale + lo, lo)
    return out.reshape(*x.shape[:-1], groups * group)[..., :a].astype(x.dtype)


def fake_quantize_keys(
    k: jax.Array, bits: int, group: int = 32, *, scale_dtype: DTypeLike = jnp.float16
) -> jax.Array:
    """Per-channel quantize-dequantize of keys k[..., T, D]: groups of `group` tokens per channel."""
    k = jnp.asarray(k)
    _check(bits, group)
    if k.ndim < 2:
        raise ValueError(f"k must have shape [..., T, D], got {k.shape}")
    return jnp.swapaxes(_quantize_last_axis(jnp.swapaxes(k, -1, -2), bits, group, scale_dtype), -1, -2)


def fake_quantize_values(
    v: jax.Array, bits: int, group: int = 32, *, scale_dtype: DTypeLike = jnp.float16
) -> jax.Array:
    """Per-token quantize-dequantize of values v[..., T, D]: groups of `group` channels per token."""
    v = jnp.asarray(v)
    _check(bits, group)
    if v.ndim < 2:
        raise ValueError(f"v must have shape [..., T, D], got {v.shape}")
    return _quantize_last_axis(v, bits, group, scale_dtype)
