"""The oracle for PQ decode attention: dequantize the cache, then exact fp32 softmax attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def per_head_centroids(cent: jax.Array, kv_heads: int) -> jax.Array:
    """Centroids as [K M C ds] fp32, broadcasting a shared [M C ds] codebook over kv heads."""
    cent = cent.astype(jnp.float32)
    return jnp.broadcast_to(cent, (kv_heads, *cent.shape)) if cent.ndim == 3 else cent


def dequantize(codes: jax.Array, cent: jax.Array) -> jax.Array:
    """Decode codes [B K T M] with centroids [M C ds] or [K M C ds] into vectors [B K T D] fp32."""
    batch, kv_heads, tokens, subspaces = codes.shape
    cent = per_head_centroids(cent, kv_heads)  # [K M C ds]
    head = jnp.arange(kv_heads)[None, :, None, None]
    sub = jnp.arange(subspaces)[None, None, None, :]
    parts = cent[head, sub, codes.astype(jnp.int32)]  # [B K T M ds]
    return parts.reshape(batch, kv_heads, tokens, subspaces * cent.shape[-1])


def pq_decode_attention_reference(
    q: jax.Array,
    k_codes: jax.Array,
    v_codes: jax.Array,
    k_cent: jax.Array,
    v_cent: jax.Array,
    lengths: jax.Array,
    k_res: jax.Array,
    v_res: jax.Array,
    res_lengths: jax.Array,
    scale: float | jax.Array,
) -> jax.Array:
    """Exact softmax attention over the reconstructed coded tokens plus the exact window; [B H D] in q.dtype."""
    batch, heads, head_dim = q.shape
    kv_heads, capacity, window = k_codes.shape[1], k_codes.shape[2], k_res.shape[2]
    group = heads // kv_heads
    keys = jnp.concatenate([dequantize(k_codes, k_cent), k_res.astype(jnp.float32)], axis=2)  # [B K T+R D]
    values = jnp.concatenate([dequantize(v_codes, v_cent), v_res.astype(jnp.float32)], axis=2)  # [B K T+R D]
    valid = jnp.concatenate(
        [
            jnp.arange(capacity)[None, :] < lengths[:, None],
            jnp.arange(window)[None, :] < res_lengths[:, None],
        ],
        axis=1,
    )  # [B T+R]
    qg = q.astype(jnp.float32).reshape(batch, kv_heads, group, head_dim)  # [B K G D]
    scores = scale * jnp.einsum("bkgd,bksd->bkgs", qg, keys, precision=jax.lax.Precision.HIGHEST)
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)  # [B K G T+R]
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)  # all-masked rows: avoid inf - inf
    weights = jnp.where(valid[:, None, None, :], jnp.exp(scores - peak), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)  # all-masked rows give zeros
    out = jnp.einsum("bkgs,bksd->bkgd", probs, values, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(batch, heads, head_dim).astype(q.dtype)
