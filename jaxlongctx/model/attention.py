"""Grouped-query softmax attention over slot-indexed keys (prefill, decode and ARMT segments)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so rows with no visible key give zeros-weighted averages, never NaN
PREFILL_CHUNK = 512  # query rows per block in long causal prefill (512 measured fastest on CPU at 4K)


def attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, q_slot: jnp.ndarray,
              key_valid: jnp.ndarray, *, heads_major: bool = False) -> jnp.ndarray:
    """Causal GQA attention: query t sees key slot s iff `key_valid[b, s]` and `s <= q_slot[b, t]`.

    q `[B, T, H, hd]`, k/v `[B, S, K, hd]` (or `[B, K, S, hd]` with `heads_major`, the dense cache
    layout), q_slot `[B, T]` int, key_valid `[B, S]` bool -> `[B, T, H, hd]`.
    Scores, softmax and the weighted sum accumulate in float32.
    """
    b, t, h, hd = q.shape
    kv, num_slots = (k.shape[1], k.shape[2]) if heads_major else (k.shape[2], k.shape[1])
    keys = "bksd" if heads_major else "bskd"
    qg = q.reshape(b, t, kv, h // kv, hd)  # B T K G hd
    # scores in the dot's natural output order [B, K, T, G, S]: any other order costs a transpose of
    # every score (measured 1.8x slower prefill attention on CPU)
    scores = jnp.einsum(f"btkgd,{keys}->bktgs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (hd ** -0.5)
    slots = jnp.arange(num_slots)
    visible = key_valid[:, None, :] & (slots[None, None, :] <= q_slot[:, :, None])  # B T S
    scores = jnp.where(visible[:, None, :, None], scores, _MASKED)
    # softmax with the normalisation applied to the [.., hd] output instead of every score: one pass
    # over the scores fewer
    weights = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    total = jnp.sum(weights, axis=-1).transpose(0, 2, 1, 3)  # B T K G
    out = jnp.einsum(f"bktgs,{keys}->btkgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return (out / total[..., None]).reshape(b, t, h, hd).astype(q.dtype)


def decode_attention(q: jnp.ndarray, cache_k: jnp.ndarray, cache_v: jnp.ndarray, k_new: jnp.ndarray,
                     v_new: jnp.ndarray, visible: jnp.ndarray) -> jnp.ndarray:
    """One new token per row attending over the cache and over its own key/value, which are not yet in
    the cache: the softmax joins both parts, so the step never writes into a copy of the cache first.

    q `[B, 1, H, hd]`, cache_k/v `[B, K, S, hd]`, k_new/v_new `[B, 1, K, hd]`, visible `[B, S]` (cached
    slots this token sees) -> `[B, 1, H, hd]`. Scores, softmax and the weighted sum accumulate in float32.
    """
    b, _, h, hd = q.shape
    kv = cache_k.shape[1]
    qg = q.reshape(b, kv, h // kv, hd)  # B K G hd
    scale = hd ** -0.5
    scores = jnp.einsum("bkgd,bksd->bkgs", qg, cache_k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None, :], scores, _MASKED)
    own = jnp.einsum("bkgd,bkd->bkg", qg, k_new[:, 0].astype(qg.dtype), preferred_element_type=jnp.float32) * scale
    top = jnp.maximum(jnp.max(scores, axis=-1), own)  # B K G
    weights, own_weight = jnp.exp(scores - top[..., None]), jnp.exp(own - top)
    total = jnp.sum(weights, axis=-1) + own_weight
    out = jnp.einsum("bkgs,bksd->bkgd", weights.astype(cache_v.dtype), cache_v, preferred_element_type=jnp.float32)
    out = out + own_weight[..., None] * v_new[:, 0, :, None, :].astype(jnp.float32)
    return (out / total[..., None]).reshape(b, 1, h, hd).astype(q.dtype)


def causal_prefill_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray,
                             key_valid: jnp.ndarray, chunk: int = PREFILL_CHUNK) -> jnp.ndarray:
    """Causal attention where query t sits at slot t; long inputs run in blocks of `chunk` queries
    that only read the key prefix they can see (half the work of a full mask, bounded score memory).

    q `[B, T, H, hd]`, k/v `[B, T, K, hd]`, key_valid `[B, T]` -> `[B, T, H, hd]`.
    """
    b, t = q.shape[:2]
    if t <= chunk:
        return attention(q, k, v, jnp.broadcast_to(jnp.arange(t), (b, t)), key_valid)
    outs = []
    for start in range(0, t, chunk):
        end = min(start + chunk, t)
        slots = jnp.broadcast_to(jnp.arange(start, end), (b, end - start))
        outs.append(attention(q[:, start:end], k[:, :end], v[:, :end], slots, key_valid[:, :end]))
    return jnp.concatenate(outs, axis=1)
