"""Retrieval answers over a quantized KV cache: one full-precision prefill, then greedy decoding per cache.

This follows PQ generation (MILLION): the prompt is prefilled in full precision, its keys/values are
then quantized into the cache, and every answer token attends over that cache plus the exact keys of
the tokens decoded since (the recent window). A quantized cache is given as a `KVTransform` (see
`jaxlongctx.kv_quality.kv_transform`); attention over its reconstruction is what the lookup-table
kernel computes. Some prompt tokens may stay exact: the last ones (MILLION's recent window) and those
the prompt's last tokens attend to most (`jaxlongctx.kvcache.observed_tokens`). One prefill per item
serves every cache.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxlongctx.data.chat_retrieval import RetrievalItem
from jaxlongctx.data.haystack import CODE_DIGITS
from jaxlongctx.kvcache.observed_tokens import SPAN, ObservingPrefill, observed_slots, pinned_prompt_tokens
from jaxlongctx.model.llama import decode_hidden, forward_hidden, forward_with
from jaxlongctx.model.model import Model
from jaxlongctx.train.evaluate import KVTransform


class PromptCache:
    """The full-precision prefill of one prompt, padded to `capacity` slots: keys/values `[L, 1, S, K, hd]`;
    with `observe`, also the queries of its last `observe` tokens `[L, 1, observe, H, hd]` (`q_observed`)."""

    def __init__(self, model: Model, prompt: np.ndarray, capacity: int, observe: int = 0):
        n = int(prompt.size)
        if n >= capacity:
            raise ValueError(f"prompt of {n} tokens does not fit a cache of {capacity} slots")
        if not 0 <= observe < n:
            raise ValueError(f"observe must be in [0, {n}) for a prompt of {n} tokens, got {observe}")
        ids = np.zeros((1, capacity), np.int32)
        ids[0, :n] = prompt
        self.length, self.mask = n, jnp.asarray(np.arange(capacity)[None] < n)
        self.observe, self.q_observed = observe, None
        if observe:
            self.k, self.v, self.q_observed = _observing_prefill(model, observe)(
                model.params, jnp.asarray(ids), self.mask
            )
        else:
            self.k, self.v = _compiled(model)[0](model.params, jnp.asarray(ids), self.mask)


def _compiled(model: Model) -> tuple[Callable, Callable]:
    """Jitted prefill (keys/values of a full forward) and greedy decode step, cached on the model."""
    fns = model.__dict__.get("_kv_retrieval_fns")
    if fns is None:

        def prefill(params, ids, mask):  # ids/mask [B, S] -> k, v [L, B, S, K, hd]
            return forward_hidden(model.merge(params), ids, mask, collect_kv=True)[1]

        def step(params, token, position, cache_k, cache_v, key_valid):  # token/position [1, 1]
            module = model.merge(params)
            h, cache_k, cache_v = decode_hidden(
                module, token, position, position[0, 0], cache_k, cache_v, key_valid
            )
            return module.head(h)[:, 0], cache_k, cache_v

        fns = model.__dict__["_kv_retrieval_fns"] = (jax.jit(prefill), jax.jit(step, donate_argnums=(3, 4)))
    return fns


def _observing_prefill(model: Model, observe: int) -> Callable:
    """Jitted prefill returning k, v `[L, B, S, K, hd]` and the last `observe` tokens' queries, cached on the model."""
    fns = model.__dict__.setdefault("_kv_retrieval_observing", {})
    if observe not in fns:

        def prefill(params, ids, mask):
            attend = ObservingPrefill(mask, observed_slots(mask, observe))
            return forward_with(model.merge(params), ids, mask, attend)[1]

        fns[observe] = jax.jit(prefill)
    return fns[observe]


@partial(jax.jit, static_argnames=("keep", "span"))
def _observed_exact(
    mask: jnp.ndarray, q_observed: jnp.ndarray, k: jnp.ndarray, keep: int, span: tuple[int, int]
) -> jnp.ndarray:
    """The `keep` tokens per layer and kv head the observed queries weight most: `[L, B, S, K]`."""
    return pinned_prompt_tokens(mask, 0, keep, q_observed, k, span=span)


@lru_cache(maxsize=32)
def _quantizer(transform: KVTransform) -> Callable:
    """`quantize_layers` of one transform, jitted once (every item of a retrieval set reuses it)."""
    return jax.jit(partial(quantize_layers, transform))


def quantize_layers(
    transform: KVTransform, k: jnp.ndarray, v: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Apply a per-layer K/V transform to stacked keys/values `[L, B, S, K, hd]`."""
    return jax.lax.map(lambda x: transform(*x), (k, v, jnp.arange(k.shape[0])))


def answer(
    model: Model,
    prompt_cache: PromptCache,
    item: RetrievalItem,
    transform: KVTransform | None,
    recent_exact: int = 0,
    observed_exact: int = 0,
    observed_span: tuple[int, int] = SPAN,
) -> np.ndarray:
    """Greedy code digits `[CODE_DIGITS]` after the forced answer prefix, the prompt's K/V through
    `transform` except its last `recent_exact` tokens (MILLION's recent window) and, per layer and kv
    head, the `observed_exact` tokens the prompt's last tokens attend to most, kept exact (the prompt
    cache must have observed them; each token scored over `observed_span`, `observed_exact_mask`)."""
    k, v = prompt_cache.k, prompt_cache.v
    if observed_exact and prompt_cache.q_observed is None:
        raise ValueError("observed_exact needs a PromptCache made with observe > 0")
    if transform is not None:
        # pad slots repeat the last prompt token, so a quantizer with statistics over groups of tokens
        # (the uniform baseline) sees only the prompt's own values
        last = jnp.minimum(jnp.arange(k.shape[2]), prompt_cache.length - 1)
        kq, vq = _quantizer(transform)(k[:, :, last], v[:, :, last])
        exact = (jnp.arange(k.shape[2]) >= prompt_cache.length - recent_exact)[None, None, :, None, None]
        if observed_exact:
            chosen = _observed_exact(
                prompt_cache.mask, prompt_cache.q_observed, k, observed_exact, observed_span
            )  # [L B S K]
            exact = exact | chosen[..., None]
        k, v = jnp.where(exact, k, kq), jnp.where(exact, v, vq)
    cache_k, cache_v = (x.transpose(0, 1, 3, 2, 4) for x in (k, v))  # [L, B, K, S, hd]
    state = {"k": cache_k, "v": cache_v, "valid": prompt_cache.mask, "position": prompt_cache.length}
    step = _compiled(model)[1]

    def feed(token: int) -> jnp.ndarray:  # the token's logits-of-next [1, V]; its k/v join the cache exactly
        at = state["position"]
        state["valid"] = state["valid"].at[0, at].set(True)
        logits, state["k"], state["v"] = step(
            model.params,
            jnp.full((1, 1), token, jnp.int32),
            jnp.full((1, 1), at, jnp.int32),
            state["k"],
            state["v"],
            state["valid"],
        )
        state["position"] = at + 1
        return logits

    for token in item.answer_prefix:
        logits = feed(int(token))
    digits = []
    for i in range(CODE_DIGITS):
        digits.append(int(jnp.argmax(logits[0])))
        if i + 1 < CODE_DIGITS:
            logits = feed(digits[-1])
    return np.asarray(digits, np.int32)
