"""The device side of continuous batching: B decode slots over one batched cache, one jitted step that
decodes every slot at once (per-slot positions and sampling), and a freshly prefilled request written
into a free slot between steps.

The caches and the model code are `jaxlongctx.generate`'s: the dense cache's prefill and
`decode_hidden`, the PQ cache's `pq_prefill` and `pq_decode_hidden` (which keep per-row lengths
already). A slot's row of the cache belongs to its request alone; rows of free slots are decoded too
(the step has a fixed shape) and overwritten when the slot is taken.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlongctx.cache_choice import PQKV
from jaxlongctx.decode_loop import bucket_length
from jaxlongctx.generate import _prefill as dense_prefill
from jaxlongctx.kvcache.dense import DenseCache
from jaxlongctx.kvcache.pq_cache import PQCache
from jaxlongctx.model import llama
from jaxlongctx.model.llama import decode_hidden
from jaxlongctx.model.model import Model
from jaxlongctx.pq_generate import place_codebooks, pq_decode_hidden, pq_prefill
from jaxlongctx.serve.sampling import choose_per_slot
from jaxlongctx.sharding import put_batch

_WARMUP_WIDTH = 16  # prompt width of the prefill that allocates the batched cache


@dataclass
class SlotSampling:
    """Per-slot sampling settings, host arrays `[B]`: temperature (0 = greedy), top_p (1 = off), the
    raw keys of the seeds `[B, ...]` and each slot's step count (folded into its key)."""

    temperature: np.ndarray
    top_p: np.ndarray
    key_data: np.ndarray
    steps: np.ndarray

    @classmethod
    def empty(cls, batch: int, key_shape: tuple[int, ...]) -> SlotSampling:
        return cls(
            np.zeros(batch, np.float32),
            np.ones(batch, np.float32),
            np.zeros((batch, *key_shape), np.uint32),
            np.zeros(batch, np.int32),
        )

    @property
    def any_sampled(self) -> bool:
        return bool((self.temperature > 0).any())


def _padded(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """One prompt right-padded to its compile bucket, as `jaxlongctx.generate` pads it: ids, mask `[1, W]`."""
    width = bucket_length(len(ids))
    padded, mask = np.zeros((1, width), np.int32), np.zeros((1, width), bool)
    padded[0, : len(ids)], mask[0, : len(ids)] = ids, True
    return padded, mask


def _write_row(batched: Any, row: Any, axes: Any, b: jnp.ndarray) -> Any:
    """Every leaf of `row` (batch 1) written into row `b` of the same leaf of `batched`, along its
    batch axis (`axes`, a tree of ints like `batched`); a shorter leaf fills the leading slots."""
    return jax.tree.map(
        lambda buf, x, ax: jax.lax.dynamic_update_slice_in_dim(buf, x, b, ax), batched, row, axes
    )


class BatchDecoder(abc.ABC):
    """B slots of one model's batched cache: `admit` prefills a prompt into a slot, `step` decodes
    every slot once. Positions are the host's (`[B]`, the next token's position per slot)."""

    def __init__(self, model: Model, batch: int, context: int):
        self.model = model
        self.batch = batch
        self.context = context
        self.weights = model.params  # gathered once: building the tree costs milliseconds per step
        self.mesh = model.mesh
        self._steps: dict[bool, Any] = {}

    def _put(self, x: np.ndarray) -> jax.Array:
        return put_batch(x, self.mesh)

    def _call_step(self, fn: Any, *args: Any) -> Any:
        """Run a step function; with several slots it is traced with XLA's products for the weights
        (`IN_PLACE_WEIGHT_ROWS` 1; the cache is still read in place): the in-place matvec kernel is the
        faster program for one row and was 4x slower than XLA's dot for 8 (SmolLM2, bf16, 2 cores)."""
        saved = llama.IN_PLACE_WEIGHT_ROWS
        llama.IN_PLACE_WEIGHT_ROWS = saved if self.batch == 1 else 1
        try:
            return fn(*args)
        finally:
            llama.IN_PLACE_WEIGHT_ROWS = saved

    @abc.abstractmethod
    def admit(self, slot: int, ids: list[int]) -> None:
        """Prefill prompt `ids` into `slot`; its first token is chosen by the next `step`."""

    @abc.abstractmethod
    def _step_fn(self, sampled: bool) -> Any:
        """The jitted step `(*_leading_args(), temperature, top_p, key_data, steps, active, positions,
        *_trailing_args()) -> (ids [B], logits [B, V], cache)`."""

    def _leading_args(self) -> tuple:
        return self.weights, self.cache, self.logits

    def _trailing_args(self) -> tuple:
        return ()

    def step(self, active: np.ndarray, positions: np.ndarray, sampling: SlotSampling) -> np.ndarray:
        """Choose every slot's next token and run it through the model; returns the ids `[B]`."""
        args = (sampling.temperature, sampling.top_p, sampling.key_data, sampling.steps, active, positions)
        tok, self.logits, self.cache = self._call_step(
            self._step_fn(sampling.any_sampled),
            *self._leading_args(),
            *(self._put(x) for x in args),
            *self._trailing_args(),
        )
        return np.asarray(tok)

    def cache_bytes(self) -> int:
        """Bytes of the batched cache."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(self.cache))


class DenseBatchDecoder(BatchDecoder):
    """Slots over a dense cache `[L, B, K, S, hd]` used as a ring: every step writes all rows' new
    tokens at one slot, the cursor, which then moves on (as `jaxlongctx.generate` writes one slot per
    step); a request joining writes its prompt's n tokens into the n slots before the cursor of its
    row (clearing the rest of it), so its tokens always occupy the (at most S) slots behind the
    cursor and a write never lands on one of them. Attention does not depend on where a key lies:
    each carries its RoPE position, and `key_valid` marks the row's own slots."""

    def __init__(self, model: Model, batch: int, context: int):
        super().__init__(model, batch, context)
        self.capacity = bucket_length(
            context
        )  # >= context: a row holds at most context - 1 tokens before a write
        self.cursor = 0
        self._prefills: dict[int, Any] = {}
        ids, mask = np.zeros((batch, _WARMUP_WIDTH), np.int32), np.zeros((batch, _WARMUP_WIDTH), bool)
        mask[:, 0] = True  # one token per row: finite logits in free rows
        fill = jax.jit(partial(dense_prefill, model, self.capacity))
        self.logits, self.cache = fill(self.weights, self._put(ids), self._put(mask))  # [B, V], the cache
        self._insert = jax.jit(self._insert_row, donate_argnums=(0, 1))

    def _insert_row(self, cache: DenseCache, logits, row: DenseCache, row_logits, b, start):
        """Prefilled `row` (slots [0, W)) into row b, its slots rotated to begin at `start`."""
        pad = self.capacity - row.capacity
        ring = lambda x, axis: jnp.roll(
            jnp.pad(x, [(0, 0)] * axis + [(0, pad)] + [(0, 0)] * (x.ndim - axis - 1)), start, axis
        )
        row = DenseCache(ring(row.k, 3), ring(row.v, 3), ring(row.key_valid, 1))
        return _write_row(cache, row, DenseCache(1, 1, 0), b), _write_row(logits, row_logits, 0, b)

    def admit(self, slot: int, ids: list[int]) -> None:
        padded, mask = _padded(ids)
        width = padded.shape[1]
        if width not in self._prefills:
            self._prefills[width] = jax.jit(partial(dense_prefill, self.model, width))
        row_logits, row = self._prefills[width](self.weights, self._put(padded), self._put(mask))
        start = jnp.int32((self.cursor - len(ids)) % self.capacity)
        self.cache, self.logits = self._insert(
            self.cache, self.logits, row, row_logits, jnp.int32(slot), start
        )

    def _step_fn(self, sampled: bool):
        if sampled not in self._steps:
            model, capacity = self.model, self.capacity

            def step(
                params,
                cache: DenseCache,
                logits,
                temperature,
                top_p,
                key_data,
                steps,
                active,
                positions,
                slot,
            ):
                tok = choose_per_slot(sampled, logits, temperature, top_p, key_data, steps)
                module = model.merge(params)
                written = (jnp.arange(capacity) == slot)[None]
                key_valid = active[:, None] & (cache.key_valid | written)  # free rows: nothing to read
                h, k, v = decode_hidden(
                    module, tok[:, None], positions[:, None], slot, cache.k, cache.v, key_valid
                )
                return tok, module.head(h)[:, 0], DenseCache(k, v, key_valid)

            self._steps[sampled] = jax.jit(step, donate_argnums=(1, 2))
        return self._steps[sampled]

    def _trailing_args(self) -> tuple:
        return (jnp.int32(self.cursor),)

    def step(self, active: np.ndarray, positions: np.ndarray, sampling: SlotSampling) -> np.ndarray:
        tok = super().step(active, positions, sampling)
        self.cursor = (self.cursor + 1) % self.capacity
        return tok


class PQBatchDecoder(BatchDecoder):
    """Slots over a PQ cache (`PQKV`): each row keeps its own coded length and exact window, as in
    `jaxlongctx.pq_generate`; a free slot's row is emptied every step so it never grows."""

    def __init__(self, model: Model, batch: int, context: int, choice: PQKV):
        super().__init__(model, batch, context)
        self.choice = choice
        self.capacity = bucket_length(context + choice.window)  # a flush writes R code slots
        self.codebooks = place_codebooks(choice.codebooks, self.mesh)
        self._prefills: dict[int, Any] = {}
        ids, mask = np.zeros((batch, _WARMUP_WIDTH), np.int32), np.zeros((batch, _WARMUP_WIDTH), bool)
        mask[:, 0] = True
        self.logits, self.cache = self._prefill_fn(_WARMUP_WIDTH)(
            self.weights, self.codebooks, self._put(ids), self._put(mask)
        )
        self._insert = jax.jit(
            lambda cache, logits, row, row_logits, b: (
                _write_row(cache, row, PQCache(1, 1, 1, 1, 0, 0, 0), b),
                _write_row(logits, row_logits, 0, b),
            ),
            donate_argnums=(0, 1),
        )

    def _prefill_fn(self, width: int):
        if width not in self._prefills:
            model, c, capacity = self.model, self.choice, self.capacity

            def prefill(params, codebooks, ids, mask):
                k_cent, v_cent, k_w, v_w = codebooks
                module = model.merge(params)
                return pq_prefill(
                    module, k_cent, v_cent, capacity, c.window, c.keep_prompt_tail_exact,
                    ids, mask, c.sinks, c.observed, k_w, v_w,
                )  # fmt: skip

            self._prefills[width] = jax.jit(prefill)
        return self._prefills[width]

    def admit(self, slot: int, ids: list[int]) -> None:
        padded, mask = _padded(ids)
        row_logits, row = self._prefill_fn(padded.shape[1])(
            self.weights, self.codebooks, self._put(padded), self._put(mask)
        )
        self.cache, self.logits = self._insert(self.cache, self.logits, row, row_logits, jnp.int32(slot))

    def _step_fn(self, sampled: bool):
        if sampled not in self._steps:
            model, c = self.model, self.choice

            def step(
                params,
                codebooks,
                cache: PQCache,
                logits,
                temperature,
                top_p,
                key_data,
                steps,
                active,
                positions,
            ):
                tok = choose_per_slot(sampled, logits, temperature, top_p, key_data, steps)
                module = model.merge(params)
                k_cent, v_cent, k_w, v_w = codebooks
                empty = lambda x: None if x is None else jnp.where(active, x, 0)
                cache = cache._replace(
                    lengths=empty(cache.lengths),
                    window_lengths=empty(cache.window_lengths),
                    pinned=empty(cache.pinned),
                )
                h, cache = pq_decode_hidden(
                    module,
                    k_cent,
                    v_cent,
                    tok[:, None],
                    positions[:, None],
                    cache,
                    c.backend,
                    c.window,
                    k_w,
                    v_w,
                )
                return tok, module.head(h)[:, 0], cache

            self._steps[sampled] = jax.jit(step, donate_argnums=(2, 3))
        return self._steps[sampled]

    def _leading_args(self) -> tuple:
        return self.weights, self.codebooks, self.cache, self.logits
