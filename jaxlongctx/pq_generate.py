"""Generation over the PQ KV cache (MILLION): full-precision prefill, then lookup-table decode attention.

Prefill attends in full precision over the prompt, then encodes the prompt's K/V into a
preallocated `PQCache`. Each decode step flushes full windows (one batch), writes the new
token's exact K/V into the window and attends through `pallas_kernels.pq_decode_attention`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlongctx.cache_choice import PQKV
from jaxlongctx.decode_loop import Request, bucket_length, choose_next, last_real_index
from jaxlongctx.kvcache.model_codebooks import check_codebooks
from jaxlongctx.kvcache.pq_cache import PQCache, flush_full_rows
from jaxlongctx.model import llama
from jaxlongctx.model.attention_strategies import PQDecode
from jaxlongctx.model.layers import DecoderLayer, Dense
from jaxlongctx.model.llama import Llama, forward_hidden
from jaxlongctx.model.model import Model
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.sharding import LOGICAL_AXES, per_kv_shard, put, put_batch


def pq_prefill(
    module: Llama,
    k_cent: jnp.ndarray,
    v_cent: jnp.ndarray,
    capacity: int,
    window: int,
    keep_tail_exact: bool,
    ids: jnp.ndarray,
    mask: jnp.ndarray,
) -> tuple[jnp.ndarray, PQCache]:
    """Full-precision forward over ids/mask `[B, T]`; returns last-token logits `[B, V]` and the encoded cache."""
    h, (k, v) = forward_hidden(module, ids, mask, collect_kv=True)  # k/v: L B T K D
    logits = module.head(jnp.take_along_axis(h, last_real_index(mask)[:, None, None], axis=1))[:, 0]
    encode = partial(PQCache.from_prefill, capacity=capacity, window=window, keep_tail_exact=keep_tail_exact)
    return logits, per_kv_shard(encode, _cache_specs(mask), k, v, mask, k_cent, v_cent)


def _cache_specs(rows: jnp.ndarray) -> PQCache:
    """PQ cache layout on a mesh: rows split like `rows` (a batch-leading array), kv heads over tp."""
    return PQCache.partition_specs(jax.typeof(rows).sharding.spec[0], LOGICAL_AXES["kv_heads"])


def place_codebooks(
    k_cent: jnp.ndarray, v_cent: jnp.ndarray, mesh: Mesh | None
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Stacked centroids on the model's mesh: per-kv-head ones `[L, K, M, C, ds]` split over tp, shared
    ones `[L, M, C, ds]` replicated; unchanged without a mesh."""
    if mesh is None:
        return k_cent, v_cent
    heads = (None, LOGICAL_AXES["kv_heads"]) if k_cent.ndim == 5 else ()
    sharding = NamedSharding(mesh, P(*heads))
    return put(k_cent, sharding), put(v_cent, sharding)


def pq_decode_hidden(
    module: Llama,
    k_cent: jnp.ndarray,
    v_cent: jnp.ndarray,
    ids: jnp.ndarray,
    positions: jnp.ndarray,
    cache: PQCache,
    backend: str = "auto",
) -> tuple[jnp.ndarray, PQCache]:
    """One decode step: ids/positions `[B, 1]`, stacked centroids `[L, (K,) M, C, ds]` -> hidden `[B, 1, D]`, cache."""
    cache = per_kv_shard(flush_full_rows, _cache_specs(cache.lengths), cache, k_cent, v_cent)
    cos, sin = module.rope(positions)
    at = cache.window_lengths  # window slot of the new token, per row

    def body(layer: DecoderLayer, dense: Dense, h, xs):
        i, k_win, v_win, kc, vc = xs  # one layer: [B K R D], [(K,) M C ds]
        # every layer's codes [L B K T M]: layer i's are read in place (sliced on a mesh)
        attend = PQDecode(cache.k_codes, cache.v_codes, kc, vc, cache.lengths, k_win, v_win, at, backend, i)
        return layer(h, cos, sin, attend, dense)

    xs = (jnp.arange(cache.k_codes.shape[0]), cache.k_window, cache.v_window, k_cent, v_cent)
    h, (k_win, v_win) = module.scan_decode_layers(body, module.embed_ids(ids), xs)
    return h, cache._replace(k_window=k_win, v_window=v_win, window_lengths=at + 1)


def _decode_step(
    model: Model,
    sampler: tuple,
    stop: tuple[int, ...],
    pad_id: int,
    backend: str,
    params,
    k_cent,
    v_cent,
    cache: PQCache,
    logits,
    key,
    done,
    positions,
):
    """Choose the next token from `logits`, then run it through the model over the PQ cache."""
    tok, done = choose_next(sampler, stop, pad_id, logits, key, done)
    module = model.merge(params)
    h, cache = pq_decode_hidden(module, k_cent, v_cent, tok[:, None], positions[:, None], cache, backend)
    return tok, done, module.head(h)[:, 0], cache


def generate_pq(
    model: Model,
    ids: Any,
    params: SamplingParams,
    cache: PQKV,
    *,
    attention_mask: Any = None,
    progress: bool = False,
    timings: dict | None = None,
    stream: Callable[[np.ndarray], Any] | None = None,
) -> np.ndarray:
    """`jaxlongctx.generate` over a PQ-compressed KV cache; same arguments and result (ids `[B, T + new]`)."""
    check_codebooks(model, cache.codebooks)
    if cache.codebooks.weighted:
        raise ValueError(
            "these codebooks weight channels (calibrated with --weighting attention); the PQ cache "
            "does not apply encode weights yet, so generate with codebooks calibrated without weighting"
        )
    req = Request.parse(model, ids, params, attention_mask)
    model.check_length(req.ids.shape[1] + req.max_new_tokens)
    ids_p, mask_p = req.padded_prompt()
    capacity = bucket_length(ids_p.shape[1] + req.max_new_tokens + cache.window)  # a flush writes R slots
    prefill, step = _compiled(
        model, capacity, cache.window, cache.keep_prompt_tail_exact, *req.static_key, cache.backend
    )
    k_cent, v_cent = place_codebooks(*cache.codebooks.stacked(), model.mesh)

    weights = model.params  # gathered once: the parameter tree costs milliseconds to build per step
    t0 = time.perf_counter()
    logits, pq_cache = jax.block_until_ready(
        prefill(weights, k_cent, v_cent, put_batch(ids_p, model.mesh), put_batch(mask_p, model.mesh))
    )
    if timings is not None:
        timings["prefill_s"] = time.perf_counter() - t0
    positions = jnp.asarray(req.mask.sum(axis=1), jnp.int32)

    def run(pq_cache, logits, key, done, i):
        return step(weights, k_cent, v_cent, pq_cache, logits, key, done, positions + i)

    return req.decode(
        logits, pq_cache, run, progress=progress, desc="decode (pq)", timings=timings, stream=stream
    )


def _compiled(
    model: Model,
    capacity: int,
    window: int,
    keep_tail: bool,
    sampler: tuple,
    stop: tuple,
    pad_id: int,
    backend: str,
):
    """Jitted PQ prefill and decode step for these static settings (cached on the model)."""
    fns = model.__dict__.setdefault("_pq_generate_fns", {})
    key = (capacity, window, keep_tail, sampler, stop, pad_id, backend, llama.IN_PLACE_DECODE)
    if key not in fns:

        def prefill(params, k_cent, v_cent, ids, mask):
            return pq_prefill(model.merge(params), k_cent, v_cent, capacity, window, keep_tail, ids, mask)

        fns[key] = (
            jax.jit(prefill),
            jax.jit(partial(_decode_step, model, sampler, stop, pad_id, backend), donate_argnums=(3,)),
        )
    return fns[key]
