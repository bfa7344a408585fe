"""ARMT generation: every segment of the prompt but its last runs through a schedule (writing the
memory state); the prompt's last segment (1..S tokens) stays open as the decoding window, so the
answer is generated with the question in view even when the prompt fills whole segments. Decoded
tokens join the window and read (never write) the memory state. The window holds up to 2S tokens;
once full it is committed as two segments (writing the memory state) and decoding goes on in plain
segments of S tokens, each committed when it fills. `generation_logits` gives the logits this layout
computes for a whole sequence, so that greedy decoding equals its repeated argmax.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlongctx.armt.memory import MemoryState, read, zero_state
from jaxlongctx.armt.segments import compact, segment, token_rows
from jaxlongctx.armt.sequential import segment_through_layers
from jaxlongctx.cache_choice import ARMTMemory
from jaxlongctx.decode_loop import Request, choose_next
from jaxlongctx.kvcache.dense import DenseCache
from jaxlongctx.model.attention_strategies import SlotAttention, SlotWriteDecode
from jaxlongctx.model.rope import rope_tables
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.sharding import put_batch
from jaxlongctx.validation import check_ids


def _window_pass(model: Any, params: Any, state: MemoryState, ids: jnp.ndarray, n: jnp.ndarray):
    """Window rows (ids `[B, W]`, `n [B]` real) through every layer, reading the memory state without
    writing it; returns the base module, hidden states `[B, W, D]`, keys / values and the valid mask."""
    base, memory_params = model.merge(params)
    b, w = ids.shape
    valid = jnp.arange(w)[None] < n[:, None]
    slots = jnp.broadcast_to(jnp.arange(w), (b, w))
    cos, sin = rope_tables(slots, model.inv_freq)

    def body(layer, h, xs):
        weights, a, z = xs
        h = read(h, weights, a, z, model.armt)
        return layer(h, cos, sin, SlotAttention(slots, valid, collect_kv=True))

    h, (k, v) = base.scan_layers(body, base.embed_ids(ids), (memory_params.layers(), state.A, state.z))
    return base, h, k, v, valid


def _prefill(
    model: Any, params: Any, state: MemoryState, ids: jnp.ndarray, n: jnp.ndarray
) -> tuple[jnp.ndarray, DenseCache]:
    """The prompt's window (ids `[B, 2S]`, `n [B]` >= 1 real) -> next-token logits `[B, V]` and its cache."""
    base, h, k, v, valid = _window_pass(model, params, state, ids, n)
    last = base.head(jnp.take_along_axis(h, (n - 1)[:, None, None], axis=1))[:, 0]
    return last, DenseCache.from_prefill(k, v, valid, ids.shape[1])


def _window_logits(
    model: Any, params: Any, state: MemoryState, ids: jnp.ndarray, n: jnp.ndarray
) -> jnp.ndarray:
    """Logits `[B, W, V]` of every window row (ids `[B, W]`, `n [B]` real)."""
    base, h, *_ = _window_pass(model, params, state, ids, n)
    return base.head(h)


def _decode_step(
    model: Any,
    sampler: tuple,
    stop: tuple[int, ...],
    pad_id: int,
    params: Any,
    state: MemoryState,
    cache: DenseCache,
    window: jnp.ndarray,
    pos: jnp.ndarray,
    logits: jnp.ndarray,
    key: jax.Array,
    done: jnp.ndarray,
):
    """Pick the next token `[B]` and run it at window slot `pos [B]`; returns it, the done flags,
    its logits `[B, V]`, the cache and the window's ids `[B, 2S]`."""
    tok, done = choose_next(sampler, stop, pad_id, logits, key, done)
    base, memory_params = model.merge(params)
    hit = jnp.arange(window.shape[1])[None] == pos[:, None]  # B 2S: each row's slot (selects, not scatters,
    window = jnp.where(hit, tok[:, None], window)  # so rows may be split over devices)
    key_valid = cache.key_valid | hit
    cos, sin = rope_tables(pos[:, None], model.inv_freq)

    def body(layer, h, xs):
        weights, a, z, ck, cv = xs  # one layer's memory weights, memory state and cache [B, K, 2S, hd]
        h = read(h, weights, a, z, model.armt)
        return layer(h, cos, sin, SlotWriteDecode(ck, cv, hit, pos, key_valid))

    h, (ck, cv) = base.scan_layers(
        body, base.embed_ids(tok[:, None]), (memory_params.layers(), state.A, state.z, cache.k, cache.v)
    )
    return tok, done, base.head(h)[:, 0], DenseCache(ck, cv, key_valid), window


def _commit(
    model: Any,
    params: Any,
    state: MemoryState,
    cache: DenseCache,
    seg_ids: jnp.ndarray,
    commit: jnp.ndarray,
    first: jnp.ndarray,
) -> tuple[MemoryState, DenseCache]:
    """Run the full segments `seg_ids [B, S]` of rows in `commit [B]` with their memory tokens (writing
    the memory state) and empty those rows' caches."""
    s = seg_ids.shape[1]
    state, _ = segment_through_layers(model, params, state, seg_ids, jnp.where(commit, s, 0), first & commit)
    return state, cache._replace(key_valid=cache.key_valid & ~commit[:, None])


def compiled_decoding(model: Any, name: str, prefill: Any, step: Any, commit: Any, static_key: tuple):
    """Jitted `prefill`, token `step` and `commit` of one ARMT decoding for `static_key` (sampler, stop,
    pad id); the step and commit donate their cache. Cached on the model under `name`."""
    cache = model.__dict__.setdefault(name, {})
    if static_key not in cache:
        sampler, stop, pad_id = static_key
        cache[static_key] = (
            jax.jit(partial(prefill, model)),
            jax.jit(partial(step, model, sampler, stop, pad_id), donate_argnums=(2,)),
            jax.jit(partial(commit, model), donate_argnums=(2,)),
        )
    return cache[static_key]


def window_start(prompt_length: Any, segment_size: int) -> Any:
    """Where decoding's window opens on the fixed grid: the start of the prompt's last segment (int
    or array of lengths >= 1)."""
    return (prompt_length - 1) // segment_size * segment_size


def window_starts(
    model: Any, ids: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """Where each left-aligned prompt row's window opens `[B]`, the start of its last segment under the
    model's segmentation (rows `ids [B, T]`, `lengths [B]` >= 1), and each row's segment starts before
    it (`model.segments(ids, opens, before)` then cuts the prompts once; None on the fixed grid)."""
    if model.segmentation == "fixed":
        return window_start(lengths, model.armt.segment_size), None
    cuts = model.segment_starts(ids, lengths)
    return np.array([starts[-1] for starts in cuts], np.int64), [starts[:-1] for starts in cuts]


def _prompt_state(
    model: Any, ids: np.ndarray, opens: np.ndarray, before: list[np.ndarray] | None, schedule: str
) -> MemoryState:
    """Memory state after the segments of left-aligned rows `ids [B, T]` ahead of their windows
    (`window_starts`)."""
    if opens.max() == 0:
        return zero_state(model, ids.shape[0])
    state, _ = model.run_segments(model.params, model.segments(ids, opens, before)[0], schedule)
    return state


def _window_rows(ids: np.ndarray, starts: np.ndarray, stops: np.ndarray, width: int) -> np.ndarray:
    """Each row's tokens `ids[r, starts[r]:stops[r]]`, left-aligned in `[B, width]` (zero-padded)."""
    out = np.zeros((ids.shape[0], width), np.int32)
    for r, (a, b) in enumerate(zip(starts, stops)):
        out[r, : b - a] = ids[r, a:b]
    return out


def window_logits(model: Any, state: MemoryState, ids: np.ndarray, n: np.ndarray) -> jnp.ndarray:
    """Logits `[B, W, V]` of decoding-window rows `ids [B, W]` (`n [B]` real tokens each) that read the
    memory `state` without writing it, as decoding computes them (compiled once per model and width)."""
    fns = model.__dict__.setdefault("_generate_fns", {})
    if "window" not in fns:
        fns["window"] = jax.jit(partial(_window_logits, model))
    mesh = model.base.mesh
    return fns["window"](
        model.params,
        state,
        put_batch(np.asarray(ids, np.int32), mesh),
        put_batch(np.asarray(n, np.int32), mesh),
    )


def generation_logits(model: Any, ids: Any, prompt_length: int, schedule: str = "diagonal") -> jnp.ndarray:
    """The logits `[B, T, V]` that decoding after the first `prompt_length` tokens of `ids [B, T]`
    (no padding) computes at every position: those of the plain forward, except in the decoding window
    `[o, o + 2S)` that starts with the prompt's last segment, whose rows read the memory state of the
    segments before `o` and attend across the window. Greedy decoding equals its repeated argmax."""
    ids = check_ids(ids, model.config.vocab_size)
    b, t = ids.shape
    if (
        isinstance(prompt_length, bool)
        or not isinstance(prompt_length, (int, np.integer))
        or not 1 <= prompt_length <= t
    ):
        raise ValueError(
            f"prompt_length must be an integer in [1, {t}] (the ids' length), got {prompt_length!r}"
        )
    S, V = model.armt.segment_size, model.config.vocab_size
    start, before = window_starts(model, ids, np.full(b, int(prompt_length)))  # B
    stop = np.minimum(t, start + 2 * S)
    if start.max():
        segs, slots = model.segments(ids, start, before)
        state, prefix = model.run_segments(model.params, segs, schedule)  # nS B S V
        prefix = token_rows(prefix, slots, int(start.max()))  # B max(start) V
    else:
        state, prefix = zero_state(model, b), jnp.zeros((b, 0, V), jnp.float32)
    window = window_logits(model, state, _window_rows(ids, start, stop, 2 * S), stop - start)
    rest = None
    if t > stop.min():  # a window was committed as two segments: plain segments from there on
        segs = segment(_window_rows(ids, start, np.full(b, t), t - int(start.min())), t - start, S)
        segs = segs._replace(first=segs.first & (start == 0))  # continues the prompt's memory state
        _, rest = model.run_segments(model.params, segs, schedule, state)  # nS B S V
        rest = token_rows(rest, None, rest.shape[0] * S)  # B nS*S V, from each row's window start
    if np.all(start == start[0]):  # one window for every row: prefix, window, rest side by side
        o, e = int(start[0]), int(stop[0])
        return jnp.concatenate(
            [prefix, window[:, : e - o]] + ([rest[:, e - o : t - o]] if t > e else []), axis=1
        )
    # rows' windows differ: each position's source in [prefix | window | rest] (before, in, after its window)
    pos, o = np.arange(t)[None], start[:, None]
    source = np.where(pos < o, pos, prefix.shape[1] + np.where(pos < stop[:, None], pos - o, 2 * S + pos - o))
    parts = [prefix, window] + ([] if rest is None else [rest])
    return jnp.take_along_axis(jnp.concatenate(parts, axis=1), jnp.asarray(source)[..., None], axis=1)


def generate_ids(
    model: Any,
    ids: Any,
    sampling: SamplingParams,
    memory: ARMTMemory,
    *,
    attention_mask: Any = None,
    progress: bool = False,
    timings: dict | None = None,
    stream: Callable[[np.ndarray], Any] | None = None,
) -> np.ndarray:
    """Generate `sampling.max_new_tokens` after `ids [B, T]` (pads anywhere, per `attention_mask`);
    returns ids `[B, T + new]`. The prompt's segments but its last run through `memory.schedule`;
    decoding reads the memory only, in the window opened by the prompt's last segment (see the module
    docstring). `timings` (a dict) receives `prefill_s` (prompt segments and window), `decode_s` and
    `decode_steps` (window commits included)."""
    S = model.armt.segment_size
    req = Request.parse(model, ids, sampling, attention_mask)
    ids_c, lengths, _ = compact(req.ids, req.mask)
    start, before = window_starts(model, ids_c, lengths)  # B (every row has a real token)
    params, mesh = model.params, model.base.mesh
    prefill, step, commit = compiled_decoding(
        model, "_generate_fns", _prefill, _decode_step, _commit, req.static_key
    )
    t0 = time.perf_counter()
    state = _prompt_state(model, ids_c, start, before, memory.schedule)
    window = _window_rows(ids_c, start, lengths, 2 * S)
    logits, cache = jax.block_until_ready(
        prefill(params, state, put_batch(window, mesh), put_batch(lengths - start, mesh))
    )
    if timings is not None:
        timings["prefill_s"] = time.perf_counter() - t0

    def run(carry, logits, key, done, i):
        state, cache, window, pos, opened, first = (
            carry  # pos [B]: next slot; opened [B]: in the first window
        )
        tok, done, logits, cache, window = step(
            params, state, cache, window, put_batch(pos.astype(np.int32), mesh), logits, key, done
        )
        pos = pos + 1
        filled = pos == np.where(opened, 2 * S, S)
        if filled.any() and i + 1 < req.max_new_tokens:  # commit full windows: write memory, restart cache
            state, cache = commit(
                params, state, cache, window[:, :S], put_batch(filled, mesh), put_batch(first, mesh)
            )
            first = first & ~filled
            if (filled & opened).any():  # the first window holds two segments
                state, cache = commit(
                    params,
                    state,
                    cache,
                    window[:, S:],
                    put_batch(filled & opened, mesh),
                    put_batch(first, mesh),
                )
            opened, pos = opened & ~filled, np.where(filled, 0, pos)
        return tok, done, logits, (state, cache, window, pos, opened, first)

    carry = (state, cache, put_batch(window, mesh), lengths - start, np.ones(len(lengths), bool), start == 0)
    return req.decode(logits, carry, run, progress=progress, timings=timings, stream=stream)
