"""Generation as the ARMT authors' reference generates (spec/armt_published.md 5), for models with the
published cell (a sink or a sliding window): every generated token's logits equal the forward pass over
the prompt plus the tokens generated so far.

The prompt is cut on the fixed grid; every segment but its last runs through a schedule and is
*committed* (memory state and window written). The last chunk (1..S tokens) stays *open*, and when it
holds S tokens and one more arrives it is committed and the new token opens the next segment. Where
the reference recomputes the whole open segment at every step, decoding here keeps, per layer, a cache
of the open segment's post-RoPE keys and values (`OpenCache`: the sink row in slot 0, open token i in
slot i + 1) next to the committed window. Tokens never see the current segment's memory-token rows,
so a step runs only the new token's row, reading the committed memory state. A commit runs only the M
memory-token rows through the layers against those caches (writing A and z), makes the cached token
keys and values the new window, and computes the next segment's sink row once.

Every pass attends with the forward's own mask (`segment_visibility` of the full segment, sliced to
the rows it runs), so the version options (`ARMTConfig.mem_mem_mask`, ...) hold here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlongctx.armt.cell import segment_layout, segment_visibility
from jaxlongctx.armt.generation import _window_rows, compiled_decoding
from jaxlongctx.armt.memory import MemoryState, read, write, zero_state
from jaxlongctx.armt.segments import compact, segment
from jaxlongctx.armt.sequential import sink_row
from jaxlongctx.cache_choice import ARMTMemory
from jaxlongctx.decode_loop import Request, choose_next
from jaxlongctx.model.attention_strategies import WindowedSegment
from jaxlongctx.model.rope import rope_tables
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.sharding import put_batch


class OpenCache(NamedTuple):
    """Post-RoPE keys and values of the open segment's sink and token rows, per layer:
    `k, v [L, B, S + 1, K, hd]` (slot 0 the sink, slot i + 1 open token i)."""

    k: jnp.ndarray
    v: jnp.ndarray


def uses_open_segment(model: Any) -> bool:
    """Whether `model` generates with the reference's open segment (its cell has a sink or a window)."""
    return model.armt.sink or model.armt.sliding_window


def _visible(model: Any, rows: slice, n: jnp.ndarray, state: MemoryState) -> tuple[jnp.ndarray, int]:
    """The forward's mask for buffer `rows` of segments holding `n [B]` tokens: `[B, T, W + R]` over
    [window, buffer rows], and the window width W."""
    cfg = model.armt
    window_n = state.wn[0] if cfg.sliding_window else None  # every layer holds the same segment's window
    full = segment_visibility(n, window_n, cfg)
    return full[:, rows], full.shape[-1] - cfg.rows


def _rows_pass(
    model: Any,
    params: Any,
    state: MemoryState,
    cache: OpenCache,
    h: jnp.ndarray,
    positions: jnp.ndarray,
    visible: jnp.ndarray,
    first: jnp.ndarray | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray, MemoryState]:
    """Rows `h [B, T, D]` at RoPE `positions [B, T]` through every layer: each reads the committed memory
    state and attends to [window, open cache, its own rows] as `visible [B, T, W + S + 1 + T]` says.
    Returns the output rows, their per-layer keys and values `[L, B, T, K, hd]` and, given `first [B]`
    (memory-token rows: the write's first-segment flags), the state they write (else `state`)."""
    base, memory_params = model.merge(params)
    cfg = model.armt
    cos, sin = rope_tables(positions, model.inv_freq)

    def body(layer, h, xs):
        weights, a, z, wk, wv, ck, cv = xs
        h = read(h, weights, a, z, cfg)
        pk, pv = (ck, cv) if wk is None else (jnp.concatenate([wk, ck], 1), jnp.concatenate([wv, cv], 1))
        h, (k, v) = layer(h, cos, sin, WindowedSegment(visible, pk, pv))
        if first is not None:
            a, z = write(h, weights, a, z, first, cfg)
        return h, (k, v, a, z)

    xs = (memory_params.layers(), state.A, state.z, state.wk, state.wv, cache.k, cache.v)
    h, (k, v, A, z) = base.scan_layers(body, h, xs)
    return h, k, v, state._replace(A=A, z=z)


def _prefill(
    model: Any, params: Any, state: MemoryState, ids: jnp.ndarray, n: jnp.ndarray
) -> tuple[jnp.ndarray, OpenCache]:
    """The open segments (ids `[B, S]`, `n [B]` >= 1 tokens) as sink and token rows: the last real
    token's logits `[B, V]` and the open cache."""
    base, memory_params = model.merge(params)
    cfg, S = model.armt, model.armt.segment_size
    rows = slice(0, S + 1)
    tok = base.embed_ids(ids)
    sink = _rows(sink_row(memory_params), tok.shape[0], tok.dtype, n)
    positions, _ = segment_layout(n, cfg)
    visible, w = _visible(model, rows, n, state)
    visible = jnp.concatenate(
        [visible[..., :w], jnp.zeros((*visible.shape[:2], S + 1), bool), visible[..., w : w + S + 1]], -1
    )
    empty = _empty_cache(model, tok.shape[0], tok.dtype)
    h, k, v, _ = _rows_pass(
        model, params, state, empty, jnp.concatenate([sink, tok], 1), positions[:, rows], visible
    )
    last = base.head(jnp.take_along_axis(h, n[:, None, None], axis=1))[:, 0]
    return last, OpenCache(k, v)


def _rows(x: jnp.ndarray, batch: int, dtype: Any, like: jnp.ndarray) -> jnp.ndarray:
    """Parameter rows `x [T, D]` for every batch row `[B, T, D]`, the batch laid out like `like [B]`."""
    out = jnp.broadcast_to(x.astype(dtype), (batch, *x.shape))
    sharding = jax.typeof(like).sharding
    if sharding.mesh.empty:
        return out
    return jax.sharding.reshard(out, NamedSharding(sharding.mesh, P(sharding.spec[0], None, None)))


def _empty_cache(model: Any, batch: int, dtype: Any) -> OpenCache:
    cfg = model.config
    shape = (cfg.num_layers, batch, model.armt.segment_size + 1, cfg.num_kv_heads, cfg.head_dim)
    return OpenCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _token_step(
    model: Any,
    sampler: tuple,
    stop: tuple[int, ...],
    pad_id: int,
    params: Any,
    state: MemoryState,
    cache: OpenCache,
    n: jnp.ndarray,
    logits: jnp.ndarray,
    key: jax.Array,
    done: jnp.ndarray,
):
    """Choose the next token `[B]` and run it as open token `n [B]` (slot n + 1): returns the token,
    done flags, its logits `[B, V]` and the cache with its keys and values."""
    tok, done = choose_next(sampler, stop, pad_id, logits, key, done)
    base, _ = model.merge(params)
    S = model.armt.segment_size
    slot = n + 1  # B
    visible, w = _visible(model, slice(None), n + 1, state)
    visible = jnp.take_along_axis(visible, slot[:, None, None], axis=1)  # B 1 W+R
    cols = jnp.arange(S + 1)
    seen = visible[..., w : w + S + 1] & (cols < slot[:, None, None])  # cached rows before its own
    visible = jnp.concatenate([visible[..., :w], seen, jnp.ones_like(seen[..., :1])], -1)
    h, k, v, _ = _rows_pass(model, params, state, cache, base.embed_ids(tok[:, None]), slot[:, None], visible)
    hit = (cols == slot[:, None])[None, :, :, None, None]  # 1 B S+1 1 1
    cache = OpenCache(jnp.where(hit, k, cache.k), jnp.where(hit, v, cache.v))
    return tok, done, base.head(h)[:, 0], cache


def _commit(
    model: Any, params: Any, state: MemoryState, cache: OpenCache, commit: jnp.ndarray, first: jnp.ndarray
) -> tuple[MemoryState, OpenCache]:
    """Commit the full open segments of rows in `commit [B]`: their memory-token rows write the memory
    state, their cached token keys and values become the window, and the next segment's sink row is
    computed into slot 0 of an emptied cache."""
    _, memory_params = model.merge(params)
    cfg, S = model.armt, model.armt.segment_size
    b = commit.shape[0]
    full = jnp.full((b,), S, jnp.int32)
    positions, _ = segment_layout(full, cfg)
    mem_rows = slice(cfg.mem_start, cfg.rows)
    visible, w = _visible(model, mem_rows, full, state)  # [window, buffer rows 0..S (cached), memory rows]
    memory = memory_params.memory[...]
    h = _rows(memory, b, cache.k.dtype, commit)
    _, _, _, written = _rows_pass(model, params, state, cache, h, positions[:, mem_rows], visible, first)
    if cfg.sliding_window:
        written = written._replace(wk=cache.k[:, :, 1:], wv=cache.v[:, :, 1:], wn=jnp.full_like(state.wn, S))
    keep = lambda new, old: jnp.where(commit.reshape((1, -1) + (1,) * (new.ndim - 2)), new, old)
    state = jax.tree.map(keep, written, state)
    # the next segment's sink row: position 0, sees only itself, reads the new state
    sink = _rows(sink_row(memory_params), b, cache.k.dtype, commit)
    empty = OpenCache(jnp.zeros_like(cache.k), jnp.zeros_like(cache.v))  # laid out like the cache
    visible = jnp.zeros((b, 1, w + S + 2), bool).at[..., -1].set(True)
    _, k, v, _ = _rows_pass(model, params, state, empty, sink, jnp.zeros((b, 1), jnp.int32), visible)
    new_cache = OpenCache(*(jnp.concatenate([x, e[:, :, 1:]], axis=2) for x, e in zip((k, v), empty)))
    return state, jax.tree.map(keep, new_cache, cache)


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
    stream: Callable[[np.ndarray], Any] | None = None,
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
    prefill, step, commit = compiled_decoding(
        model, "_open_segment_fns", _prefill, _token_step, _commit, req.static_key
    )
    t0 = time.perf_counter()
    if opens.max() > 0:
        state, _ = model.run_segments(params, segment(ids_c, opens, S), memory.schedule)
    else:
        state = zero_state(model, len(lengths))
    n = (lengths - opens).astype(np.int32)  # tokens in each row's open segment
    open_ids = put_batch(_window_rows(ids_c, opens, lengths, S), mesh)
    logits, cache = jax.block_until_ready(prefill(params, state, open_ids, put_batch(n, mesh)))
    if timings is not None:
        timings["prefill_s"] = time.perf_counter() - t0

    def run(carry, logits, key, done, i):
        state, cache, n, first = carry
        full = n == S
        if full.any():  # the token to come opens the next segment
            state, cache = commit(params, state, cache, put_batch(full, mesh), put_batch(first, mesh))
            n, first = np.where(full, 0, n), first & ~full
        tok, done, logits, cache = step(params, state, cache, put_batch(n, mesh), logits, key, done)
        if step_logits is not None:
            step_logits.append(logits)
        return tok, done, logits, (state, cache, n + 1, first)

    if step_logits is not None:
        step_logits.append(logits)
    return req.decode(
        logits, (state, cache, n, opens == 0), run, progress=progress, timings=timings, stream=stream
    )
