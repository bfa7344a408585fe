"""The sequential schedule (spec 1, the ground truth): segment by segment, layer by layer."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxlongctx.armt.cell import cell, embed_segment
from jaxlongctx.armt.memory import MemoryState, zero_state
from jaxlongctx.armt.segments import Segments, chunk_sizes

TRACES: Counter = Counter()  # trace (= compile) count per schedule function, read by tests


def remat_cell(model: Any, fn: Callable) -> Callable:
    """`fn` (one cell), rematerialised in the backward pass (`jax.checkpoint`: only its inputs are kept,
    its activations recomputed) when `model.remat` is set (training), else `fn` itself."""
    return jax.checkpoint(fn) if getattr(model, "remat", False) else fn


def segment_through_layers(
    model: Any, params: Any, state: MemoryState, ids: jnp.ndarray, n: jnp.ndarray, first: jnp.ndarray
) -> tuple[MemoryState, jnp.ndarray]:
    """One segment (ids `[B, S]`, `n [B]`, `first [B]`) through all layers in order; returns the new
    state and the token-row logits `[B, S, V]`."""
    base, memory_params = model.merge(params)

    def body(layer, h, xs):
        weights, mem = xs
        one = lambda h, mem: cell(model.armt, model.inv_freq, layer, weights, h, mem, n, first)
        return remat_cell(model, one)(h, mem)

    h0 = embed_segment(base, memory_params.memory[...], ids, sink_row(memory_params))
    h, state = base.scan_layers(body, h0, (memory_params.layers(), state))
    return state, base.head(token_part(model.armt, h))


def sink_row(memory_params: Any) -> jnp.ndarray | None:
    """The sink row `[1, D]` of memory parameters that have one, else None."""
    return memory_params.sink[...] if hasattr(memory_params, "sink") else None


def token_part(cfg: Any, h: jnp.ndarray) -> jnp.ndarray:
    """The token rows `[..., S, D]` of segment buffers `h [..., R, D]`."""
    return h[..., cfg.lead : cfg.mem_start, :]


def _run_chunk(
    model: Any, params: Any, state: MemoryState, segs: Segments
) -> tuple[MemoryState, jnp.ndarray]:
    TRACES["sequential"] += 1

    def step(st, seg):
        return segment_through_layers(model, params, st, *seg)

    return jax.lax.scan(step, state, tuple(segs))


_run_chunk_jit = jax.jit(_run_chunk, static_argnums=0)


def sequential_forward(
    model: Any, params: Any, segs: Segments, state: MemoryState | None = None
) -> tuple[MemoryState, jnp.ndarray]:
    """Run segments `[nS, B, S]` in order from `state` (default zero); returns the final state and
    logits `[nS, B, S, V]`. Compiled per chunk size only (see `chunk_sizes`)."""
    state = zero_state(model, segs.ids.shape[1]) if state is None else state
    outs, start = [], 0
    for size in chunk_sizes(segs.count):
        state, logits = _run_chunk_jit(
            model, params, state, segs[start : start + size].place(model.base.mesh)
        )
        outs.append(logits)
        start += size
    return state, jnp.concatenate(outs, axis=0)
