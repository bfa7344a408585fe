"""The decode loop every cache shares: a validated request (`Request`), next-token choice, and the
step-by-step loop with early stop, streaming, progress and timings. Caches plug in their own step."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxlongctx.sampling import SamplingParams, select_next
from jaxlongctx.validation import check_ids, check_mask

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


def choose_next(
    sampler: tuple, stop: tuple[int, ...], pad_id: int, logits: jnp.ndarray, key: jax.Array, done: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Next ids `[B]` from logits `[B, V]`; stopped rows emit `pad_id`; returns (ids, updated done)."""
    tok = jnp.where(done, pad_id, select_next(logits, key, *sampler))
    return tok, (done | jnp.isin(tok, jnp.asarray(stop, jnp.int32))) if stop else done


@cache
def _final_choice(sampler: tuple, stop: tuple[int, ...], pad_id: int) -> Callable:
    """Jitted `choose_next` for these static settings."""
    return jax.jit(partial(choose_next, sampler, stop, pad_id))


@dataclass(frozen=True)
class Request:
    """A validated generation request (shared by the dense, PQ and ARMT decoders)."""

    ids: np.ndarray  # [B, T] int32
    mask: np.ndarray  # [B, T] bool
    max_new_tokens: int
    sampler: tuple  # (temperature, top_k, top_p)
    stop: tuple[int, ...]
    pad_id: int
    seed: int

    @classmethod
    def parse(cls, model: Any, ids: Any, params: SamplingParams, attention_mask: Any) -> Request:
        """Check ids and mask against `model` (clear ValueErrors) and resolve the stop / padding ids."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                "params must be a SamplingParams, e.g. SamplingParams(max_new_tokens=64), "
                f"got {type(params).__name__}"
            )
        config = model.config
        if params.top_k is not None and params.top_k > config.vocab_size:
            raise ValueError(f"top_k must be an integer in [1, {config.vocab_size}], got {params.top_k}")
        ids = check_ids(ids, config.vocab_size)
        mask = check_mask(attention_mask, ids)
        stop = params.resolve_stop_ids(model)
        pad_id = stop[0] if stop else (config.pad_token_id or 0)
        return cls(ids, mask, params.max_new_tokens, params.sampler, stop, pad_id, params.seed)

    @property
    def static_key(self) -> tuple:
        """The settings the jitted step depends on."""
        return self.sampler, self.stop, self.pad_id

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
