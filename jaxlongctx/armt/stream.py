"""Streaming ARMT: feed chunks of any size, several documents back to back, one pipeline.

Tokens are buffered per row until the next segment is decided (`ARMTModel.next_segment_length`: a
full segment on the fixed grid; with sentence segments the cut after the last sentence end that
fits, known one token later), so a stream is cut exactly as the one-shot call cuts the whole row (a
partial segment is never processed and rolled back). Ready segments run through the chosen schedule
at once; with the diagonal schedule they stay in flight in the pipeline between calls, so logits come out of `feed` only when their
segment leaves the last layer (concatenated over `feed`s and the final `flush` they equal the
one-shot call). Ending a document (`end_document`) turns the row's partial segment into a short
segment and marks the row's next segment as the first of a new document: it starts from a zero memory
state with the first-segment write rule, while the pipeline keeps running.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxlongctx.armt.diagonal import Pipeline, empty_pipeline, plan, run_blocks
from jaxlongctx.armt.memory import MemoryState, zero_state
from jaxlongctx.armt.segments import Segments
from jaxlongctx.armt.sequential import sequential_forward

SCHEDULES = ("diagonal", "sequential")


@dataclasses.dataclass(frozen=True)
class ARMTState:
    """Streaming state: the memory state `memory` (inside `pipe` for the diagonal schedule), per-row
    token buffers, per-row "next segment starts a document" flags and the token counts of segments in
    flight."""

    schedule: str
    memory: MemoryState | None
    pipe: Pipeline | None
    occupied: tuple[int, int] | None
    buffers: tuple[np.ndarray, ...]
    pending_first: np.ndarray
    in_flight: tuple[np.ndarray, ...]

    @property
    def batch(self) -> int:
        """Number of rows (independent streams)."""
        return len(self.buffers)

    def current_memory(self) -> MemoryState:
        """The memory state after every segment that has left the model."""
        return self.memory if self.pipe is None else self.pipe.memory


def init_state(model: Any, batch: int, schedule: str) -> ARMTState:
    """Empty streams for `batch` rows."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    memory_state = zero_state(model, batch)
    pipe = empty_pipeline(model, memory_state) if schedule == "diagonal" else None
    return ARMTState(
        schedule,
        None if pipe is not None else memory_state,
        pipe,
        None,
        tuple(np.zeros((0,), np.int32) for _ in range(batch)),
        np.ones(batch, bool),
        (),
    )


def _per_row_flags(flags: bool | Sequence[bool], batch: int) -> np.ndarray:
    arr = (
        np.broadcast_to(np.asarray(flags, bool), (batch,)) if np.ndim(flags) == 0 else np.asarray(flags, bool)
    )
    if arr.shape != (batch,):
        raise ValueError(f"end_document must be a bool or {batch} bools, got shape {arr.shape}")
    return arr


def feed(
    model: Any,
    params: Any,
    state: ARMTState,
    ids: np.ndarray | None,
    end_document: Any = False,
    drain: bool = False,
) -> tuple[ARMTState, list[jnp.ndarray]]:
    """Append ids `[B, c]` (c >= 0) to the streams, run every ready segment, optionally end the
    rows' documents and drain the pipeline; returns the new state and, per row, the logits `[t_b, V]`
    of the tokens whose segments left the model during this call."""
    S, b = model.armt.segment_size, state.batch
    ends = _per_row_flags(end_document, b)
    buffers, pending = list(state.buffers), state.pending_first.copy()
    ready: list[list[tuple[np.ndarray, bool]]] = [[] for _ in range(b)]
    for r in range(b):
        buf = buffers[r] if ids is None else np.concatenate([buffers[r], ids[r]])
        while n := model.next_segment_length(buf, bool(ends[r])):
            ready[r].append((buf[:n], bool(pending[r])))
            pending[r], buf = False, buf[n:]
        pending[r] |= ends[r]
        buffers[r] = buf
    k = max(len(x) for x in ready)
    seg_ids, seg_n, seg_first = (
        np.zeros((k, b, S), np.int32),
        np.zeros((k, b), np.int32),
        np.zeros((k, b), bool),
    )
    for r in range(b):
        for j, (toks, first) in enumerate(ready[r]):
            seg_ids[j, r, : toks.size], seg_n[j, r], seg_first[j, r] = toks, toks.size, first
    segs = Segments(seg_ids, seg_n, seg_first)
    if state.schedule == "sequential":
        memory, pipe, occupied, in_flight = state.memory, None, None, ()
        emitted, counts = [], list(seg_n)
        if k:
            memory, logits = sequential_forward(model, params, segs, memory)
            emitted = list(logits)
    else:
        blocks, occupied = plan(state.occupied, k, drain, model.config.num_layers)
        pipe, outs = run_blocks(model, params, state.pipe, blocks, segs)
        emitted = [x for out in outs for x in out]
        queue = list(state.in_flight) + list(seg_n)
        counts, in_flight, memory = queue[: len(emitted)], tuple(queue[len(emitted) :]), None
    rows = [[] for _ in range(b)]
    for logits, n in zip(emitted, counts):
        for r in range(b):
            if n[r]:
                rows[r].append(logits[r, : n[r]])
    vocab = model.config.vocab_size
    out = [jnp.concatenate(x) if x else jnp.zeros((0, vocab), jnp.float32) for x in rows]
    return ARMTState(state.schedule, memory, pipe, occupied, tuple(buffers), pending, in_flight), out
