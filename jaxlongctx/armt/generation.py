"""ARMT generation: full segments through a schedule, then cached decoding inside the current
segment, reading (never writing) the memory; a segment that fills up during decoding is committed
(run with its memory rows, writing the memory) and the cache restarts at position 0. Every
generated token therefore sees exactly what a full ARMT forward over the grown sequence gives it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlongctx.armt.memory import read
from jaxlongctx.armt.segments import compact, segment
from jaxlongctx.armt.sequential import MemoryState, segment_through_layers, zero_state
from jaxlongctx.kvcache.dense import DenseCache
from jaxlongctx.model.attention import attention
from jaxlongctx.model.rope import rope_tables
from jaxlongctx.parallel import put_batch
from jaxlongctx.generate import Request, choose_next


def _prefill(model: Any, params: Any, state: MemoryState, ids: jnp.ndarray, n: jnp.ndarray,
             last_full: jnp.ndarray) -> tuple[jnp.ndarray, DenseCache]:
    """Token rows of the partial segment (ids `[B, S]`, `n [B]` real) through every layer with memory
    reads; returns next-token logits `[B, V]` (`last_full` where n == 0) and the segment's cache."""
    base, mem = model.merge(params)
    b, s = ids.shape
    valid = jnp.arange(s)[None] < n[:, None]
    slots = jnp.broadcast_to(jnp.arange(s), (b, s))
    cos, sin = rope_tables(slots, model.inv_freq)

    def body(layer, h, xs):
        lm, a, z = xs
        h = read(h, lm, a, z)
        q, k, v = layer.project_qkv(h, cos, sin)
        return layer.finish(h, attention(q, k, v, slots, valid)), (k, v)

    h, (k, v) = base.scan_layers(body, base.embed_ids(ids), (mem.layers(), *state))
    last = base.head(jnp.take_along_axis(h, jnp.maximum(n - 1, 0)[:, None, None], axis=1))[:, 0]
    return jnp.where((n > 0)[:, None], last, last_full), DenseCache.from_prefill(k, v, valid, s)


def _decode_step(model: Any, sampler: tuple, eos: tuple[int, ...], pad_id: int, params: Any,
                 state: MemoryState, cache: DenseCache, seg_ids: jnp.ndarray, pos: jnp.ndarray,
                 logits: jnp.ndarray, key: jax.Array, done: jnp.ndarray):
    """Pick the next token `[B]` and run it at segment slot `pos [B]`; returns it, the done flags,
    its logits `[B, V]`, the cache and the current segment's ids `[B, S]`."""
    tok, done = choose_next(sampler, eos, pad_id, logits, key, done)
    base, mem = model.merge(params)
    hit = jnp.arange(seg_ids.shape[1])[None] == pos[:, None]  # B S: each row's slot (selects, not scatters,
    seg_ids = jnp.where(hit, tok[:, None], seg_ids)          # so rows may be split over devices)
    key_valid = cache.key_valid | hit
    cos, sin = rope_tables(pos[:, None], model.inv_freq)

    def body(layer, h, xs):
        lm, a, z, ck, cv = xs  # one layer's memory and cache [B, K, S, hd]
        h = read(h, lm, a, z)
        q, k, v = layer.project_qkv(h, cos, sin)
        ck = jnp.where(hit[:, None, :, None], k.swapaxes(1, 2).astype(ck.dtype), ck)
        cv = jnp.where(hit[:, None, :, None], v.swapaxes(1, 2).astype(cv.dtype), cv)
        return layer.finish(h, attention(q, ck, cv, pos[:, None], key_valid, heads_major=True)), (ck, cv)

    h, (ck, cv) = base.scan_layers(body, base.embed_ids(tok[:, None]), (mem.layers(), *state, cache.k, cache.v))
    return tok, done, base.head(h)[:, 0], DenseCache(ck, cv, key_valid), seg_ids


def _commit(model: Any, params: Any, state: MemoryState, cache: DenseCache, seg_ids: jnp.ndarray,
            commit: jnp.ndarray, first: jnp.ndarray) -> tuple[MemoryState, DenseCache]:
    """Run the full segments of rows in `commit [B]` with their memory rows (writing the memory)
    and empty those rows' caches."""
    s = seg_ids.shape[1]
    state, _ = segment_through_layers(model, params, state, seg_ids, jnp.where(commit, s, 0), first & commit)
    return state, cache._replace(key_valid=cache.key_valid & ~commit[:, None])


def _compiled(model: Any, sampler: tuple, eos: tuple, pad_id: int):
    cache = model.__dict__.setdefault("_generate_fns", {})
    key = (sampler, eos, pad_id)
    if key not in cache:
        cache[key] = (jax.jit(partial(_prefill, model)),
                      jax.jit(partial(_decode_step, model, sampler, eos, pad_id), donate_argnums=(2,)),
                      jax.jit(partial(_commit, model), donate_argnums=(2,)))
    return cache[key]


def generate_ids(model: Any, ids: Any, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 eos_id: int | list[int] | None = None, attention_mask: Any = None,
                 progress: bool = False, schedule: str = "diagonal") -> np.ndarray:
    """Generate `max_new_tokens` after `ids [B, T]` (pads anywhere, per `attention_mask`); returns
    ids `[B, T + new]`. Full segments run through `schedule`; decoding reads the memory only."""
    if schedule not in ("diagonal", "sequential"):
        raise ValueError(f"schedule must be 'diagonal' or 'sequential', got {schedule!r}")
    cfg, S = model.config, model.armt.segment_size
    req = Request.parse(cfg, ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, eos_id=eos_id, attention_mask=attention_mask)
    b = req.ids.shape[0]
    ids_c, lengths, _ = compact(req.ids, req.mask)
    full = lengths // S
    part = lengths - full * S
    params, mesh = model.params, model.base.mesh
    state, last_full = zero_state(model, b), jnp.zeros((b, cfg.vocab_size), jnp.float32)
    if full.max() > 0:
        segs = segment(ids_c, full * S, S)
        state, logits = model.run_segments(params, segs, schedule)  # nS B S V
        last = put_batch(np.arange(segs.count)[None] == full[:, None] - 1, mesh).astype(jnp.float32)  # B nS
        last_full = jnp.einsum("bs,sbv->bv", last, logits[:, :, S - 1], precision=jax.lax.Precision.HIGHEST)
    seg_ids = np.zeros((b, S), np.int32)
    for r in range(b):
        seg_ids[r, :part[r]] = ids_c[r, full[r] * S:lengths[r]]
    prefill, step, commit = _compiled(model, *req.static_key)
    logits, cache = prefill(params, state, put_batch(seg_ids, mesh), put_batch(part, mesh), last_full)

    def run(carry, logits, key, done, i):
        state, cache, seg_ids, pos, first = carry  # pos [B]: next slot in the current segment
        tok, done, logits, cache, seg_ids = step(params, state, cache, seg_ids, put_batch(pos.astype(np.int32), mesh),
                                                 logits, key, done)
        pos = pos + 1
        filled = pos == S
        if filled.any() and i + 1 < req.max_new_tokens:  # commit full segments: write memory, restart cache
            state, cache = commit(params, state, cache, seg_ids, put_batch(filled, mesh), put_batch(first, mesh))
            first, pos = first & ~filled, np.where(filled, 0, pos)
        return tok, done, logits, (state, cache, seg_ids, pos, first)

    return req.decode(logits, (state, cache, put_batch(seg_ids, mesh), part.copy(), full == 0), run, progress=progress)
