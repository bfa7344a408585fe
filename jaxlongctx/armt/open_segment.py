"""Generation as the ARMT authors' reference generates (spec/armt_published.md 5), for models with the
published cell (a sink or a sliding window): every generated token's logits equal the forward pass over
the prompt plus the tokens generated so far.

The prompt is cut on the fixed grid; every segment but its last runs through a schedule and is
*committed* (memory state and window written). The last chunk (1..S tokens) stays *open*: each step
runs the open segment through every layer from the committed state (one segment pass, as the forward
computes it) and takes its last real token row. When the open segment holds S tokens and one more
arrives, the state that S-token pass wrote is committed and the new token opens the next segment.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlongctx.armt.generation import _window_rows
from jaxlongctx.armt.memory import MemoryState, zero_state
from jaxlongctx.armt.segments import compact, segment
from jaxlongctx.armt.sequential import segment_through_layers
from jaxlongctx.cache_choice import ARMTMemory
from jaxlongctx.decode_loop import Request, choose_next
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.sharding import put_batch


def uses_open_segment(model: Any) -> bool:
    """Whether `model` generates with the reference's open segment (its cell has a sink or a window)."""
    return model.armt.sink or model.armt.sliding_window


def _open_pass(
    model: Any, params: Any, state: MemoryState, ids: jnp.ndarray, n: jnp.ndarray, first: jnp.ndarray
) -> tuple[jnp.ndarray, MemoryState]:
    """The open segments (ids `[B, S]`, `n [B]` >= 1 tokens, `first [B]`) from the committed `state`:
    the last real token's logits `[B, V]` and the state this pass writes (committed when it fills)."""
    new, logits = segment_through_layers(model, params, state, ids, n, first)
    return jnp.take_along_axis(logits, (n - 1)[:, None, None], axis=1)[:, 0], new


def _step(
    model: Any,
    sampler: tuple,
    stop: tuple[int, ...],
    pad_id: int,
    params: Any,
    committed: MemoryState,
    written: MemoryState,
    ids: jnp.ndarray,
    n: jnp.ndarray,
    first: jnp.ndarray,
    logits: jnp.ndarray,
    key: jax.Array,
    done: jnp.ndarray,
):
    """Choose the next token `[B]`, append it to the open segments (committing full ones first) and run
    them; returns the token, done flags, its logits and the new (committed, written, ids, n, first)."""
    tok, done = choose_next(sampler, stop, pad_id, logits, key, done)
    S = ids.shape[1]
    full = n == S  # B: the open segment commits and the token opens the next one
    committed = jax.tree.map(
        lambda new, old: jnp.where(full.reshape((1, -1) + (1,) * (new.ndim - 2)), new, old),
        written,
        committed,
    )
    n = jnp.where(full, 0, n)
    first = first & ~full
    slot = jnp.arange(S)[None] == n[:, None]
    ids = jnp.where(slot, tok[:, None], jnp.where(full[:, None], 0, ids))
    n = n + 1
    logits, written = _open_pass(model, params, committed, ids, n, first)
    return tok, done, logits, (committed, written, ids, n, first)


def _compiled(model: Any, sampler: tuple, stop: tuple, pad_id: int):
    """Jitted open pass and decode step for these static settings (cached on the model)."""
    cache = model.__dict__.setdefault("_open_segment_fns", {})
    key = (sampler, stop, pad_id)
    if key not in cache:
        cache[key] = (
            jax.jit(partial(_open_pass, model)),
            jax.jit(partial(_step, model, sampler, stop, pad_id)),
        )
    return cache[key]


def generate_open_segment(
    model: Any,
    ids: Any,
    sampling: SamplingParams,
    memory: ARMTMemory,
    *,
    attention_mask: Any = None,
    progress: bool = False,
    timings: dict | None = None,
    step_logits: list | None = None,
) -> np.ndarray:
    """Generate `sampling.max_new_tokens` after `ids [B, T]` (pads anywhere, per `attention_mask`; rows
    are compacted) as the reference does; returns ids `[B, T + new]`. The committed prompt segments run
    through `memory.schedule`. `timings` receives `prefill_s`, `decode_s` and `decode_steps`;
    `step_logits` (a list) the logits `[B, V]` each new token is chosen from."""
    S = model.armt.segment_size
    req = Request.parse(model, ids, sampling, attention_mask)
    ids_c, lengths, _ = compact(req.ids, req.mask)
    opens = (lengths - 1) // S * S  # B: where each row's open chunk starts
    params, mesh = model.params, model.base.mesh
    open_pass, step = _compiled(model, *req.static_key)
    t0 = time.perf_counter()
    if opens.max() > 0:
        state, _ = model.run_segments(params, segment(ids_c, opens, S), memory.schedule)
    else:
        state = zero_state(model, len(lengths))
    open_ids = _window_rows(ids_c, opens, lengths, S)
    carry = tuple(put_batch(x, mesh) for x in (open_ids, (lengths - opens).astype(np.int32), opens == 0))
    logits, written = jax.block_until_ready(open_pass(params, state, *carry))
    if timings is not None:
        timings["prefill_s"] = time.perf_counter() - t0

    def run(carry, logits, key, done, i):
        tok, done, logits, carry = step(params, *carry, logits, key, done)
        if step_logits is not None:
            step_logits.append(logits)
        return tok, done, logits, carry

    if step_logits is not None:
        step_logits.append(logits)
    return req.decode(logits, (state, written, *carry), run, progress=progress, timings=timings)
