"""Tokens kept exact beside a quantized KV cache: a recent window and the first (attention-sink) tokens.

`recent_exact_attention` is causal attention where each query reads its most recent keys exactly and
the older ones quantized: what a decoding step over a quantized cache with an exact recent window sees
(MILLION's batch-delayed quantization, KIVI's full-precision residual). Measuring perplexity with it,
rather than with every key quantized, shows what the window is worth; `keep_sinks_exact` does the
same for the first few positions, which many heads attend to heavily.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

_MASKED = -1e30  # finite: a row with no visible key averages with zero weights, never NaN
QUERY_BLOCK = 512  # queries per block; a block's fp32 scores are [B, K, G, 512, S]


def recent_exact_attention(
    q: jnp.ndarray,
    k: jnp.ndarray,
    v: jnp.ndarray,
    k_quant: jnp.ndarray,
    v_quant: jnp.ndarray,
    key_valid: jnp.ndarray,
    recent: int,
    query_block: int = QUERY_BLOCK,
) -> jnp.ndarray:
    """Causal GQA attention: query t reads key/value s exactly when t - s < `recent`, else quantized.

    q `[B, T, H, hd]`; k, v (exact) and k_quant, v_quant `[B, T, K, hd]`; key_valid `[B, T]` -> `[B, T, H, hd]`.
    Query t sits at slot t. Scores and softmax in float32.
    """
    b, t, h, hd = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, hd)
    outs = []
    for start in range(0, t, query_block):
        stop = min(t, start + query_block)
        qb = qg[:, start:stop]  # [B, c, K, G, hd]
        dist = jnp.arange(start, stop)[:, None] - jnp.arange(stop)[None, :]  # [c, S] query - key slot
        exact = (dist >= 0) & (dist < recent)
        visible = (dist >= 0)[None] & key_valid[:, None, :stop]  # [B, c, S]

        def scores(keys):
            return jnp.einsum("bckgd,bskd->bkgcs", qb, keys[:, :stop], preferred_element_type=jnp.float32)

        s = jnp.where(exact, scores(k), scores(k_quant)) * hd**-0.5
        s = jnp.where(visible[:, None, None], s, _MASKED)
        p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        p = p / jnp.sum(p, axis=-1, keepdims=True)
        out = jnp.einsum("bkgcs,bskd->bckgd", jnp.where(exact, p, 0.0), v[:, :stop].astype(jnp.float32))
        out = out + jnp.einsum(
            "bkgcs,bskd->bckgd", jnp.where(exact, 0.0, p), v_quant[:, :stop].astype(jnp.float32)
        )
        outs.append(out.reshape(b, stop - start, h, hd))
    return jnp.concatenate(outs, axis=1).astype(q.dtype)


def keep_sinks_exact(
    transform: Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray], tuple[jnp.ndarray, jnp.ndarray]], sinks: int
) -> Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray], tuple[jnp.ndarray, jnp.ndarray]]:
    """A K/V transform (k, v `[B, T, K, hd]`, layer) that leaves the first `sinks` slots (attention sinks) exact."""
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0, got {sinks}")

    def transformed(k, v, layer):
        k_quant, v_quant = transform(k, v, layer)
        return k_quant.at[:, :sinks].set(k[:, :sinks]), v_quant.at[:, :sinks].set(v[:, :sinks])

    return transformed
