"""The device side of continuous batching: B decode slots over one batched cache, one jitted step that
decodes every slot at once (per-slot positions and sampling), and a freshly prefilled request written
into a free slot between steps (a prompt of at most one chunk prefilled at once, a longer one read
chunk by chunk, `chunked_prefill`, between steps).

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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlongctx.cache_choice import PQKV
from jaxlongctx.decode_loop import bucket_length
from jaxlongctx.generate import _prefill as dense_prefill
from jaxlongctx.kvcache.dense import DenseCache
from jaxlongctx.kvcache.observed_tokens import OBSERVE
from jaxlongctx.kvcache.pq_cache import PQCache
from jaxlongctx.model import llama
from jaxlongctx.model.llama import decode_hidden
from jaxlongctx.model.model import Model
from jaxlongctx.pq_generate import place_codebooks, pq_decode_hidden, pq_encode_prompt, pq_prefill
from jaxlongctx.serve.chunked_prefill import DEFAULT_CHUNK, PromptReading, check_chunk, chunk_plan, read_chunk
from jaxlongctx.serve.sampling import choose_per_slot
from jaxlongctx.sharding import LOGICAL_AXES, put, put_batch

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
    every slot once. Positions are the host's (`[B]`, the next token's position per slot). A prompt
    longer than `chunk` tokens is read by `start_reading`, `read_next_chunk` (once per chunk) and
    `admit_read`."""

    def __init__(self, model: Model, batch: int, context: int, chunk: int = DEFAULT_CHUNK):
        self.model = model
        self.batch = batch
        self.context = context
        self.chunk = chunk
        self.weights = model.params  # gathered once: building the tree costs milliseconds per step
        self.mesh = model.mesh
        self._steps: dict[bool, Any] = {}
        self._read_chunk: Any = None  # the jitted `read_chunk`
        self._finish_fns: dict[int, Any] = {}
        check_chunk(chunk)
        # prompt buffer slots: every chunk's writes fit (a prompt has < context tokens)
        self.prompt_slots = bucket_length(context) + chunk

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

    def chunked(self, ids: list[int]) -> bool:
        """Whether this prompt is read chunk by chunk (longer than one chunk)."""
        return len(ids) > self.chunk

    def admit(self, slot: int, ids: list[int]) -> None:
        """Prefill prompt `ids` (at most one chunk) into `slot` at once; its first token is chosen by
        the next `step`."""
        padded, mask = _padded(ids)
        row_logits, row = self._prefill_row(padded, mask)
        self._insert(slot, row, row_logits, len(ids))

    def start_reading(self, ids: list[int]) -> PromptReading:
        """A long prompt to read chunk by chunk (nothing runs yet)."""
        return PromptReading(ids, chunk_plan(len(ids), self.chunk))

    def read_next_chunk(self, job: PromptReading) -> None:
        """Run the next chunk of `job` through the model into its prompt buffer."""
        if job.k is None:
            cfg = self.model.config
            shape = (cfg.num_layers, 1, self.prompt_slots, cfg.num_kv_heads, cfg.head_dim)  # L 1 S K hd
            zeros = np.zeros(shape, self.model.dtype)
            if self.mesh is None:
                job.k, job.v = jnp.asarray(zeros), jnp.asarray(zeros)
            else:  # kv heads over tp, like the keys a layer makes (one row: never split over dp)
                heads = NamedSharding(self.mesh, P(None, None, None, LOGICAL_AXES["kv_heads"], None))
                job.k, job.v = put(zeros, heads), put(zeros, heads)
        start, count = job.plan[job.done]
        n = len(job.ids)
        ids = np.zeros((1, self.chunk), np.int32)
        ids[0, :count] = job.ids[start : start + count]
        observe = np.clip(n - OBSERVE + np.arange(OBSERVE) - start, 0, self.chunk - 1).astype(np.int32)
        if self._read_chunk is None:
            model = self.model
            fn = lambda params, *args: read_chunk(model.merge(params), *args)
            self._read_chunk = jax.jit(fn, donate_argnums=(5, 6))
        job.logits, job.q_observed, job.k, job.v = self._read_chunk(
            self.weights,
            self._put(ids),
            jnp.int32(start),
            jnp.int32(count),
            jnp.asarray(observe),
            job.k,
            job.v,
        )
        job.done += 1

    def admit_read(self, slot: int, job: PromptReading) -> None:
        """A fully read prompt's buffer into `slot` (as `admit` would have prefilled it)."""
        n = len(job.ids)
        width = bucket_length(n)
        if width not in self._finish_fns:
            self._finish_fns[width] = jax.jit(partial(self._row_from_prompt, width))
        row = self._finish_fns[width](job.k, job.v, jnp.int32(n), job.q_observed, *self._row_args())
        self._insert(slot, row, job.logits, n)
        job.k = job.v = None

    @abc.abstractmethod
    def _prefill_row(self, ids: np.ndarray, mask: np.ndarray) -> tuple[jax.Array, Any]:
        """A whole-prompt prefill of padded ids/mask `[1, W]`: logits `[1, V]` and a cache row."""

    @abc.abstractmethod
    def _row_from_prompt(self, width: int, k, v, n, q_observed, *row_args) -> Any:
        """A cache row from a prompt buffer `k/v [L, 1, S, K, hd]` holding `n` tokens (its first `width`
        slots read; `q_observed [L, 1, OBSERVE, H, hd]`: the queries of its last tokens)."""

    def _row_args(self) -> tuple:
        """Device arrays `_row_from_prompt` takes after its own (the codebooks)."""
        return ()

    @abc.abstractmethod
    def _insert(self, slot: int, row: Any, row_logits: jax.Array, n: int) -> None:
        """Write a prefilled `n`-token cache row and its logits into `slot`."""

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

    def __init__(self, model: Model, batch: int, context: int, chunk: int = DEFAULT_CHUNK):
        super().__init__(model, batch, context, chunk)
        # >= context: a row holds at most context - 1 tokens before a write
        self.capacity = bucket_length(context)
        self.cursor = 0
        self._prefills: dict[int, Any] = {}
        ids, mask = np.zeros((batch, _WARMUP_WIDTH), np.int32), np.zeros((batch, _WARMUP_WIDTH), bool)
        mask[:, 0] = True  # one token per row: finite logits in free rows
        fill = jax.jit(partial(dense_prefill, model, self.capacity))
        self.logits, self.cache = fill(self.weights, self._put(ids), self._put(mask))  # [B, V], the cache
        self._insert_fn = jax.jit(self._insert_row, donate_argnums=(0, 1))

    def _insert_row(self, cache: DenseCache, logits, row: DenseCache, row_logits, b, start):
        """Prefilled `row` (slots [0, W)) into row b, its slots rotated to begin at `start`."""
        pad = self.capacity - row.capacity
        ring = lambda x, axis: jnp.roll(
            jnp.pad(x, [(0, 0)] * axis + [(0, pad)] + [(0, 0)] * (x.ndim - axis - 1)), start, axis
        )
        row = DenseCache(ring(row.k, 3), ring(row.v, 3), ring(row.key_valid, 1))
        return _write_row(cache, row, DenseCache(1, 1, 0), b), _write_row(logits, row_logits, 0, b)

    def _prefill_row(self, ids: np.ndarray, mask: np.ndarray) -> tuple[jax.Array, DenseCache]:
        width = ids.shape[1]
        if width not in self._prefills:
            self._prefills[width] = jax.jit(partial(dense_prefill, self.model, width))
        return self._prefills[width](self.weights, self._put(ids), self._put(mask))

    def _row_from_prompt(self, width: int, k, v, n, q_observed, *row_args) -> DenseCache:
        mask = (jnp.arange(width) < n)[None]
        return DenseCache.from_prefill(k[:, :, :width], v[:, :, :width], mask, width)

    def _insert(self, slot: int, row: DenseCache, row_logits: jax.Array, n: int) -> None:
        start = jnp.int32((self.cursor - n) % self.capacity)
        self.cache, self.logits = self._insert_fn(
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

    def __init__(self, model: Model, batch: int, context: int, choice: PQKV, chunk: int = DEFAULT_CHUNK):
        super().__init__(model, batch, context, chunk)
        self.choice = choice
        self.capacity = bucket_length(context + choice.window)  # a flush writes R code slots
        self.codebooks = place_codebooks(choice.codebooks, self.mesh)
        self._prefills: dict[int, Any] = {}
        ids, mask = np.zeros((batch, _WARMUP_WIDTH), np.int32), np.zeros((batch, _WARMUP_WIDTH), bool)
        mask[:, 0] = True
        self.logits, self.cache = self._prefill_fn(_WARMUP_WIDTH)(
            self.weights, self.codebooks, self._put(ids), self._put(mask)
        )
        self._insert_fn = jax.jit(
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

    def _prefill_row(self, ids: np.ndarray, mask: np.ndarray) -> tuple[jax.Array, PQCache]:
        return self._prefill_fn(ids.shape[1])(self.weights, self.codebooks, self._put(ids), self._put(mask))

    def _row_args(self) -> tuple:
        return (self.codebooks,)

    def _row_from_prompt(self, width: int, k, v, n, q_observed, codebooks) -> PQCache:
        c = self.choice
        k_cent, v_cent, k_w, v_w = codebooks
        mask = (jnp.arange(width) < n)[None]
        return pq_encode_prompt(
            k[:, :, :width], v[:, :, :width], mask, q_observed, k_cent, v_cent, self.capacity, c.window,
            c.keep_prompt_tail_exact, c.sinks, c.observed, k_w, v_w,
        )  # fmt: skip

    def _insert(self, slot: int, row: PQCache, row_logits: jax.Array, n: int) -> None:
        self.cache, self.logits = self._insert_fn(self.cache, self.logits, row, row_logits, jnp.int32(slot))

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
