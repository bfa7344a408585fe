"""Autoregressive generation: jitted prefill, then a jitted decode step over a static cache."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxlongctx.config import ModelConfig, eos_ids
from jaxlongctx.kvcache.dense import DenseCache
from jaxlongctx.model.llama import decode_hidden, forward_hidden
from jaxlongctx.model.model import Model
from jaxlongctx.sampling import select_next
from jaxlongctx.sharding import put_batch
from jaxlongctx.validation import check_ids, check_mask, check_positive_int

_ALL_DONE_CHECK_EVERY = 16  # decode steps between host checks for "every row has stopped"


def bucket_length(n: int) -> int:
    """Round a length up to a compile bucket: powers of two up to 1024, then multiples of 1024."""
    if n <= 1024:
        return max(16, 1 << (n - 1).bit_length())
    return -(-n // 1024) * 1024


def last_real_index(mask: jnp.ndarray) -> jnp.ndarray:
    """Index `[B]` of the last real token of each row of a `[B, T]` mask."""
    t = mask.shape[1]
    return t - 1 - jnp.argmax(mask[:, ::-1], axis=1)


def _prefill(model: Model, capacity: int, params, ids, mask):
    """Full forward over the (bucketed) prompt; returns last-token logits `[B, V]` and the filled cache."""
    module = model.merge(params)
    h, (k, v) = forward_hidden(module, ids, mask, collect_kv=True)  # k/v: L B T K hd
    last = last_real_index(mask)
    logits = module.head(jnp.take_along_axis(h, last[:, None, None], axis=1))[:, 0]
    return logits, DenseCache.from_prefill(k, v, mask, capacity)


def choose_next(
    sampler: tuple, eos: tuple[int, ...], pad_id: int, logits: jnp.ndarray, key: jax.Array, done: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Next ids `[B]` from logits `[B, V]`; stopped rows emit `pad_id`; returns (ids, updated done)."""
    tok = jnp.where(done, pad_id, select_next(logits, key, *sampler))
    return tok, (done | jnp.isin(tok, jnp.asarray(eos, jnp.int32))) if eos else done


@cache
def _final_choice(sampler: tuple, eos: tuple[int, ...], pad_id: int) -> Callable:
    """Jitted `choose_next` for these static settings."""
    return jax.jit(partial(choose_next, sampler, eos, pad_id))


def _decode_step(
    model: Model,
    sampler: tuple,
    eos: tuple[int, ...],
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
    tok, done = choose_next(sampler, eos, pad_id, logits, key, done)
    module = model.merge(params)
    key_valid = cache.key_valid | (jnp.arange(cache.capacity) == slot)  # mark `slot` (keeps sharding)
    h, k, v = decode_hidden(module, tok[:, None], positions[:, None], slot, cache.k, cache.v, key_valid)
    return tok, done, module.head(h)[:, 0], DenseCache(k, v, key_valid)


@dataclass(frozen=True)
class Request:
    """A validated generation request (shared by the dense, PQ and ARMT decoders)."""

    ids: np.ndarray  # [B, T] int32
    mask: np.ndarray  # [B, T] bool
    max_new_tokens: int
    sampler: tuple  # (temperature, top_k, top_p)
    eos: tuple[int, ...]
    pad_id: int
    seed: int

    @classmethod
    def parse(
        cls,
        config: ModelConfig,
        ids: Any,
        max_new_tokens: int,
        *,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        seed: int,
        eos_id: int | list[int] | None,
        attention_mask: Any,
    ) -> Request:
        """Check every argument (clear ValueErrors) and resolve eos / padding ids."""
        ids = check_ids(ids, config.vocab_size)
        mask = check_mask(attention_mask, ids)
        max_new_tokens = check_positive_int(max_new_tokens, "max_new_tokens")
        sampler = check_sampler(temperature, top_k, top_p, config.vocab_size)
        eos = tuple(np.atleast_1d(eos_id).tolist()) if eos_id is not None else eos_ids(config)
        pad_id = eos[0] if eos else (config.pad_token_id or 0)
        return cls(ids, mask, max_new_tokens, sampler, eos, pad_id, seed)

    @property
    def static_key(self) -> tuple:
        """The settings the jitted step depends on."""
        return self.sampler, self.eos, self.pad_id

    def padded_prompt(self) -> tuple[np.ndarray, np.ndarray]:
        """ids and mask right-padded to a compile bucket, `[B, bucket_length(T)]`."""
        b, t = self.ids.shape
        width = bucket_length(t)
        ids = np.zeros((b, width), np.int32)
        mask = np.zeros((b, width), bool)
        ids[:, :t], mask[:, :t] = self.ids, self.mask
        return ids, mask

    def decode(
        self,
        logits: jnp.ndarray,
        state: Any,
        step: Callable,
        *,
        progress: bool = False,
        desc: str = "decode",
        timings: dict | None = None,
        stream: Callable | None = None,
    ) -> np.ndarray:
        """Run `step(state, logits, key, done, i) -> (ids, done, logits, state)` up to `max_new_tokens`
        times (stopping early once every row is done); returns ids `[B, T + new]`. `timings`, if
        given, receives `decode_s` and `decode_steps` (from ready logits to the last token);
        `stream`, if given, is called with each step's ids `[B]` (numpy) as soon as they are chosen."""
        t0 = time.perf_counter()
        done = jnp.zeros((self.ids.shape[0],), bool)
        keys = jax.random.split(jax.random.key(self.seed), self.max_new_tokens)
        out = []
        for i in tqdm(range(self.max_new_tokens), desc=desc, unit="tok", disable=not progress):
            if i + 1 < self.max_new_tokens:
                tok, done, logits, state = step(state, logits, keys[i], done, i)
            else:  # the last token is only chosen: no forward pass whose logits nobody reads
                tok, done = _final_choice(*self.static_key)(logits, keys[i], done)
            out.append(tok)
            if stream is not None:
                stream(np.asarray(tok))  # the host waits for every token anyway: stop as soon as all are done
                if bool(done.all()):
                    break
            elif (i + 1) % _ALL_DONE_CHECK_EVERY == 0 and bool(done.all()):
                break
        new = np.stack([np.asarray(x) for x in out], axis=1)
        if timings is not None:
            timings.update(decode_s=time.perf_counter() - t0, decode_steps=len(out))
        new = np.pad(new, ((0, 0), (0, self.max_new_tokens - new.shape[1])), constant_values=self.pad_id)
        return np.concatenate([self.ids, new], axis=1)


def generate(
    model: Any,
    ids: Any,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_id: int | list[int] | None = None,
    attention_mask: Any = None,
    progress: bool = False,
    kv_cache: str = "dense",
    codebooks: Any = None,
    pq_window: int = 128,
    keep_prompt_tail_exact: bool = False,
    timings: dict | None = None,
    stream: Callable[[np.ndarray], Any] | None = None,
) -> np.ndarray:
    """Generate `max_new_tokens` after `ids [B, T]`; returns ids `[B, T + new]` (greedy by default).

    Rows stop independently at `eos_id` (default: the config's eos) and are then filled with it.
    kv_cache="pq" decodes over a product-quantized cache (`codebooks`, see jaxlongctx.pq_generate).
    `timings` (a dict) receives `prefill_s`, `decode_s` and `decode_steps`. `stream` (dense and PQ
    caches) is called with each new token's ids `[B]` as it is generated, e.g. a `jaxlongctx.tokenizer.TextStream`.
    """
    if kv_cache != "dense":  # checks kv_cache, the model (no ARMT) and the codebooks
        from jaxlongctx.pq_generate import generate_pq

        return generate_pq(
            model,
            ids,
            max_new_tokens,
            kv_cache=kv_cache,
            codebooks=codebooks,
            window=pq_window,
            keep_prompt_tail_exact=keep_prompt_tail_exact,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_id=eos_id,
            attention_mask=attention_mask,
            progress=progress,
            timings=timings,
            stream=stream,
        )
    if hasattr(model, "generate_ids"):  # models with their own decoding (e.g. ARMT) plug in here
        if stream is not None:
            raise ValueError("stream= is not supported for ARMT models; generate and decode the ids instead")
        return model.generate_ids(
            ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_id=eos_id,
            attention_mask=attention_mask,
            progress=progress,
            timings=timings,
        )
    if not isinstance(model, Model):
        raise ValueError(f"generate() needs a jaxlongctx Model, got {type(model).__name__}")
    req = Request.parse(
        model.config,
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_id=eos_id,
        attention_mask=attention_mask,
    )
    model.check_length(req.ids.shape[1] + req.max_new_tokens)
    ids_p, mask_p = req.padded_prompt()
    prompt_len = ids_p.shape[1]
    capacity = bucket_length(prompt_len + req.max_new_tokens)
    prefill, step = _compiled(model, capacity, *req.static_key)

    t0 = time.perf_counter()
    logits, cache = jax.block_until_ready(
        prefill(model.params, put_batch(ids_p, model.mesh), put_batch(mask_p, model.mesh))
    )
    if timings is not None:
        timings["prefill_s"] = time.perf_counter() - t0
    positions = jnp.asarray(req.mask.sum(axis=1), jnp.int32)

    def run(cache, logits, key, done, i):
        return step(model.params, cache, logits, key, done, positions + i, jnp.int32(prompt_len + i))

    return req.decode(logits, cache, run, progress=progress, timings=timings, stream=stream)


# Below this, logits / temperature overflows float32 and sampling degenerates (every id 0).
MIN_TEMPERATURE = 1e-3


def check_sampler(temperature: float, top_k: int | None, top_p: float | None, vocab: int) -> tuple:
    """Validate sampling options; returns them as a hashable tuple."""
    if (
        not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or not (temperature == 0 or temperature >= MIN_TEMPERATURE)
    ):
        raise ValueError(
            f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {temperature!r}"
        )
    if top_k is not None and not (isinstance(top_k, int) and 0 < top_k <= vocab):
        raise ValueError(f"top_k must be an integer in [1, {vocab}], got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return float(temperature), top_k, (None if top_p is None else float(top_p))


def _compiled(model: Model, capacity: int, sampler: tuple, eos: tuple, pad_id: int):
    """Jitted prefill and decode step for these static settings (cached on the model)."""
    cache = model.__dict__.setdefault("_generate_fns", {})
    key = (capacity, sampler, eos, pad_id)
    if key not in cache:
        cache[key] = (
            jax.jit(partial(_prefill, model, capacity)),
            jax.jit(partial(_decode_step, model, sampler, eos, pad_id), donate_argnums=(1,)),
        )
    return cache[key]
