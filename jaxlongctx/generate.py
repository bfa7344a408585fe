"""Autoregressive generation: jitted prefill, then a jitted decode step over a static cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlongctx.cache_choice import PQKV, ARMTMemory, CacheChoice, DenseKV, OwnMemoryModel
from jaxlongctx.decode_loop import Request, bucket_length, choose_next, last_real_index
from jaxlongctx.kvcache.dense import DenseCache
from jaxlongctx.model import llama
from jaxlongctx.model.llama import decode_hidden, forward_hidden
from jaxlongctx.model.model import Model
from jaxlongctx.pq_generate import generate_pq
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.sharding import put_batch


def _prefill(model: Model, capacity: int, params, ids, mask):
    """Full forward over the (bucketed) prompt; returns last-token logits `[B, V]` and the filled cache."""
    module = model.merge(params)
    h, (k, v) = forward_hidden(module, ids, mask, collect_kv=True, in_place=True)  # k/v: L B T K hd
    last = last_real_index(mask)
    logits = module.head(jnp.take_along_axis(h, last[:, None, None], axis=1))[:, 0]
    return logits, DenseCache.from_prefill(k, v, mask, capacity)


def _decode_step(
    model: Model,
    sampler: tuple,
    stop: tuple[int, ...],
    pad_id: int,
    params,
    cache: DenseCache,
    logits,
    key,
    done,
    positions,
    slot,
):
    """Choose the next token from `logits`, then run it through the model at cache `slot`."""
    tok, done = choose_next(sampler, stop, pad_id, logits, key, done)
    module = model.merge(params)
    key_valid = cache.key_valid | (jnp.arange(cache.capacity) == slot)  # mark `slot` (keeps sharding)
    h, k, v = decode_hidden(module, tok[:, None], positions[:, None], slot, cache.k, cache.v, key_valid)
    return tok, done, module.head(h)[:, 0], DenseCache(k, v, key_valid)


def generate(
    model: Any,
    ids: Any,
    params: SamplingParams,
    *,
    cache: CacheChoice | None = None,
    attention_mask: Any = None,
    progress: bool = False,
    timings: dict | None = None,
    stream: Callable[[np.ndarray], Any] | None = None,
) -> np.ndarray:
    """Generate `params.max_new_tokens` after `ids [B, T]` (pads per `attention_mask [B, T]`); returns
    ids `[B, T + new]`.

    Rows stop independently at `params.stop_ids` and are then filled with the first of them.
    `cache`: `DenseKV()` (default for full-attention models), `PQKV(codebooks)`, or for an ARMT model
    its own memory (`ARMTMemory()`, its default). `timings` (a dict) receives `prefill_s`, `decode_s`
    and `decode_steps`. `stream` (KV caches) is called with each new token's ids `[B]` as it is
    generated, e.g. a `jaxlongctx.tokenizer.TextStream`.
    """
    if isinstance(model, OwnMemoryModel):
        return model.generate(
            ids,
            params,
            cache=cache,
            attention_mask=attention_mask,
            progress=progress,
            timings=timings,
            stream=stream,
        )
    if not isinstance(model, Model):
        raise ValueError(f"generate() needs a jaxlongctx Model, got {type(model).__name__}")
    match cache:
        case None | DenseKV():
            return _generate_dense(model, ids, params, attention_mask, progress, timings, stream)
        case PQKV():
            return generate_pq(
                model,
                ids,
                params,
                cache,
                attention_mask=attention_mask,
                progress=progress,
                timings=timings,
                stream=stream,
            )
        case ARMTMemory():
            raise ValueError(
                "cache=ARMTMemory() is the memory of ARMT models; this is a full-attention model "
                "(use DenseKV() or PQKV(codebooks), or ARMTModel.wrap(model, ...))"
            )
    raise ValueError(f"cache must be DenseKV(), PQKV(codebooks) or ARMTMemory(), got {cache!r}")


def _generate_dense(
    model: Model,
    ids: Any,
    params: SamplingParams,
    attention_mask: Any,
    progress: bool,
    timings: dict | None,
    stream: Callable[[np.ndarray], Any] | None,
) -> np.ndarray:
    """`generate` over the dense KV cache."""
    req = Request.parse(model, ids, params, attention_mask)
    model.check_length(req.ids.shape[1] + req.max_new_tokens)
    ids_p, mask_p = req.padded_prompt()
    prompt_len = ids_p.shape[1]
    capacity = bucket_length(prompt_len + req.max_new_tokens)
    prefill, step = _compiled(model, capacity, *req.static_key)

    weights = model.params  # gathered once: the parameter tree costs milliseconds to build per step
    t0 = time.perf_counter()
    logits, cache = jax.block_until_ready(
        prefill(weights, put_batch(ids_p, model.mesh), put_batch(mask_p, model.mesh))
    )
    if timings is not None:
        timings["prefill_s"] = time.perf_counter() - t0
    positions = jnp.asarray(req.mask.sum(axis=1), jnp.int32)

    def run(cache, logits, key, done, i):
        return step(weights, cache, logits, key, done, positions + i, jnp.int32(prompt_len + i))

    return req.decode(logits, cache, run, progress=progress, timings=timings, stream=stream)


def _compiled(model: Model, capacity: int, sampler: tuple, stop: tuple, pad_id: int):
    """Jitted prefill and decode step for these static settings (cached on the model)."""
    cache = model.__dict__.setdefault("_generate_fns", {})
    key = (capacity, sampler, stop, pad_id, llama.IN_PLACE_DECODE)
    if key not in cache:
        cache[key] = (
            jax.jit(partial(_prefill, model, capacity)),
            jax.jit(partial(_decode_step, model, sampler, stop, pad_id), donate_argnums=(1,)),
        )
    return cache[key]
