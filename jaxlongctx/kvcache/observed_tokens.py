"""Prompt tokens that the prompt's last tokens attend to, kept exact beside a quantized cache.

A quantized cache blurs every key a little; over thousands of tokens that noise can bury the one key
a question needs. The prefill is exact, and the prompt's last tokens (a chat prompt's question and
the answer's opening) already attend to what they need there. So per layer and kv head, the `keep`
tokens that the last `observe` queries weight most (their softmax weights summed over those queries
and the kv head's query heads, then max-pooled over a span of neighbouring positions so that a fact's
tokens come together) are kept exact and the others quantized: SnapKV's selection of the tokens a
question needs, used to choose which tokens escape quantization.

The span reaches further forward than back (`SPAN`): a question attends to where a fact starts (its
subject, "... of the blue box is"), while an answer copies the tokens that follow (the code's digits,
read one after the other as they are generated). With SnapKV's symmetric 7-token window the fourth
digit after an attended " is" fell outside, and on 8K SmolLM2 retrieval the answers lost their last
digits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxlongctx.model.attention_strategies import CausalPrefill

OBSERVE = 32  # last prompt tokens whose attention chooses the exact tokens
SPAN = (8, 2)  # a token takes the largest weight of the 8 tokens before it, its own and the 2 after it


@dataclasses.dataclass(frozen=True)
class ObservingPrefill:
    """Causal prefill attention that also returns the post-RoPE queries at slots `slots [B, W]`.

    aux: (k, v, q_observed `[B, W, H, hd]`) per layer.
    """

    key_valid: jnp.ndarray
    slots: jnp.ndarray

    def __call__(self, q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray):
        out, (k, v) = CausalPrefill(self.key_valid, collect_kv=True)(q, k, v)
        observed = jnp.take_along_axis(q, self.slots[:, :, None, None], axis=1)  # [B, W, H, hd]
        return out, (k, v, observed)


def real_positions(mask: jnp.ndarray) -> jnp.ndarray:
    """Each slot's index among its row's real tokens `[B, S]` (pads anywhere; a pad gets the next one's)."""
    return jnp.cumsum(mask, axis=1, dtype=jnp.int32) - mask.astype(jnp.int32)


def observed_slots(mask: jnp.ndarray, observe: int) -> jnp.ndarray:
    """Slots `[B, observe]` of each row's last `observe` real tokens (pads anywhere in `mask [B, S]`)."""
    if observe < 1:
        raise ValueError(f"observe must be >= 1, got {observe}")
    real_first = jnp.argsort(~mask, axis=1, stable=True)  # [B, S] real slots in order, then pads
    lengths = mask.sum(axis=1).astype(jnp.int32)  # [B]
    nth = jnp.maximum(lengths[:, None] - observe + jnp.arange(observe, dtype=jnp.int32)[None], 0)
    return jnp.take_along_axis(real_first, nth, axis=1)


def observed_weights(q_observed: jnp.ndarray, k: jnp.ndarray, candidates: jnp.ndarray) -> jnp.ndarray:
    """Softmax weight the observed queries put on each candidate key of one layer, summed: `[B, K, S]`.

    q_observed `[B, W, H, hd]`, k `[B, S, K, hd]` post-RoPE, candidates `[B, S]`: the keys scored (the
    prompt before the observed tokens); each query's softmax runs over those keys.
    """
    b, w, h, hd = q_observed.shape
    kv_heads = k.shape[2]
    qg = q_observed.reshape(b, w, kv_heads, h // kv_heads, hd)
    scores = jnp.einsum("bwkgd,bskd->bkgws", qg, k, preferred_element_type=jnp.float32) * hd**-0.5
    seen = candidates[:, None, None, None]
    weights = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1, where=seen)
    return jnp.where(seen, weights, 0.0).sum(axis=(2, 3))


def observed_exact_mask(
    q_observed: jnp.ndarray,
    k: jnp.ndarray,
    candidates: jnp.ndarray,
    keep: int,
    span: tuple[int, int] = SPAN,
) -> jnp.ndarray:
    """Which prompt tokens of one layer stay exact: `[B, S, K]` bool, `keep` per row and kv head among
    the `candidates [B, S]` (fewer where a row has fewer), those the observed queries weight most, each
    token scored by the largest weight among the `span[0]` tokens before it, its own and the `span[1]`
    after it."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    before, after = span
    if before < 0 or after < 0:
        raise ValueError(f"span must be two counts >= 0, got {span}")
    weights = observed_weights(q_observed, k, candidates)  # [B, K, S]
    window, padding = (1, 1, before + 1 + after), ((0, 0), (0, 0), (before, after))
    pooled = jax.lax.reduce_window(weights, -jnp.inf, jax.lax.max, window, (1, 1, 1), padding)
    pooled = jnp.where(candidates[:, None], pooled, -jnp.inf)
    # the top `keep` (ties to the earlier slot, as lax.top_k); ranks, not a scatter, so that it keeps
    # the scores' (rows, kv heads) sharding on a mesh
    rank = jnp.argsort(jnp.argsort(-pooled, axis=-1, stable=True), axis=-1)  # [B, K, S]
    return ((rank < keep) & candidates[:, None]).transpose(0, 2, 1)


def pinned_prompt_tokens(
    mask: jnp.ndarray,
    sinks: int,
    keep: int = 0,
    q_observed: jnp.ndarray | None = None,
    k: jnp.ndarray | None = None,
    exact_tail: jnp.ndarray | int = 0,
    span: tuple[int, int] = SPAN,
) -> jnp.ndarray:
    """Prompt tokens a quantized cache keeps exact for good: `[L, B, S, K]` bool (L = 1 without `keep`).

    The first `sinks` real tokens of each row (attention sinks) and, with `keep`, the `keep` tokens per
    layer and kv head that the observed queries `q_observed [L, B, W, H, hd]` (the row's last W tokens,
    `ObservingPrefill`) weight most among the others before them (each scored over its `span`,
    `observed_exact_mask`), over keys `k [L, B, S, K, hd]`. The last `exact_tail [B]` real tokens
    (exact anyway, in the recent window) are never chosen, so every layer and kv head of a row pins as
    many tokens.
    """
    position = real_positions(mask)  # [B, S]
    sink = mask & (position < sinks)
    if not keep:
        return jnp.broadcast_to(sink[None, :, :, None], (1, *sink.shape, 1))
    if q_observed is None or k is None:
        raise ValueError("pinned_prompt_tokens: keep needs the observed queries and the keys")
    observe = q_observed.shape[2]
    lengths = mask.sum(axis=1, keepdims=True)
    last = jnp.maximum(observe, jnp.reshape(jnp.asarray(exact_tail), (-1, 1)))  # [B or 1, 1]
    candidates = mask & (position >= sinks) & (position < lengths - last)
    chosen = jax.lax.map(lambda x: observed_exact_mask(x[0], x[1], candidates, keep, span), (q_observed, k))
    return chosen | sink[None, :, :, None]
