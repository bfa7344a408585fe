"""Generation over the PQ KV cache (MILLION): full-precision prefill, then lookup-table decode attention.

Prefill attends in full precision over the prompt, then encodes the prompt's K/V into a
preallocated `PQCache` (pinned prompt tokens, if asked for, stay exact in its window). Each decode
step flushes full recent windows (one batch), writes the new token's exact K/V into the window and
attends through `pallas_kernels.pq_decode_attention`.
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
from jaxlongctx.kvcache.codebooks import Codebooks
from jaxlongctx.kvcache.model_codebooks import check_codebooks
from jaxlongctx.kvcache.observed_tokens import (
    OBSERVE,
    ObservingPrefill,
    observed_slots,
    pinned_prompt_tokens,
)
from jaxlongctx.kvcache.pq_cache import PQCache, exact_tail, flush_full_rows
from jaxlongctx.model import llama
from jaxlongctx.model.attention_strategies import PQDecode
from jaxlongctx.model.layers import DecoderLayer, Dense
from jaxlongctx.model.llama import Llama, forward_hidden, forward_with
from jaxlongctx.model.model import Model
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.sharding import LOGICAL_AXES, mesh_of_arrays, per_kv_shard, put, put_batch


def pq_prefill(
    module: Llama,
    k_cent: jnp.ndarray,
    v_cent: jnp.ndarray,
    capacity: int,
    window: int,
    keep_tail_exact: bool,
    ids: jnp.ndarray,
    mask: jnp.ndarray,
    sinks: int = 0,
    observed: int = 0,
    k_weights: jnp.ndarray | None = None,
    v_weights: jnp.ndarray | None = None,
) -> tuple[jnp.ndarray, PQCache]:
    """Full-precision forward over ids/mask `[B, T]`; returns last-token logits `[B, V]` and the encoded
    cache, its first `sinks` and `observed` attended-to prompt tokens per layer and kv head exact."""
    q_observed = None
    if observed:  # the last OBSERVE prompt tokens' queries choose the observed tokens
        attend = ObservingPrefill(mask, observed_slots(mask, OBSERVE))
        h, (k, v, q_observed) = forward_with(module, ids, mask, attend, in_place=True)  # k/v: L B T K D
    else:
        h, (k, v) = forward_hidden(module, ids, mask, collect_kv=True, in_place=True)
    logits = module.head(jnp.take_along_axis(h, last_real_index(mask)[:, None, None], axis=1))[:, 0]
    cache = pq_encode_prompt(
        k, v, mask, q_observed, k_cent, v_cent, capacity, window, keep_tail_exact, sinks, observed,
        k_weights, v_weights,
    )  # fmt: skip
    return logits, cache


def pq_encode_prompt(
    k: jnp.ndarray,
    v: jnp.ndarray,
    mask: jnp.ndarray,
    q_observed: jnp.ndarray | None,
    k_cent: jnp.ndarray,
    v_cent: jnp.ndarray,
    capacity: int,
    window: int,
    keep_tail_exact: bool,
    sinks: int = 0,
    observed: int = 0,
    k_weights: jnp.ndarray | None = None,
    v_weights: jnp.ndarray | None = None,
) -> PQCache:
    """A prompt's post-RoPE keys/values `k/v [L, B, T, K, D]` (real slots in `mask [B, T]`) encoded into
    a `PQCache` of `capacity` slots; with `observed`, `q_observed [L, B, OBSERVE, H, D]` are the queries
    of each row's last OBSERVE real tokens, which choose the exact tokens."""
    if observed:
        tail = exact_tail(mask.sum(axis=1).astype(jnp.int32), window) if keep_tail_exact else 0
        pinned = pinned_prompt_tokens(mask, sinks, observed, q_observed, k, tail)
    else:
        pinned = pinned_prompt_tokens(mask, sinks) if sinks else None
    mesh, heads = mesh_of_arrays(k), None
    if pinned is not None and mesh is not None:  # split like k [L B T K D]
        batch, _, heads = jax.typeof(k).sharding.spec[1:4]
        pinned = jax.sharding.reshard(pinned, NamedSharding(mesh, P(None, batch, None, heads)))

    def encode(k, v, mask, k_cent, v_cent, pinned, k_weights, v_weights):  # one (rows, kv heads) shard
        cache = PQCache.from_prefill(
            k, v, mask, k_cent, v_cent, capacity, window, keep_tail_exact,
            pinned_mask=pinned, pinned_slots=sinks + observed, k_weights=k_weights, v_weights=v_weights,
        )  # fmt: skip
        if heads is None:
            return cache
        # a row pins as many tokens in every kv head; the max over the head shards says so to shard_map
        same = lambda x: jax.lax.pmax(x, heads)
        return cache._replace(
            lengths=same(cache.lengths), window_lengths=same(cache.window_lengths), pinned=same(cache.pinned)
        )

    args = (k, v, mask, k_cent, v_cent, pinned, k_weights, v_weights)
    return per_kv_shard(encode, _cache_specs(mask), *args)


def _cache_specs(rows: jnp.ndarray) -> PQCache:
    """PQ cache layout on a mesh: rows split like `rows` (a batch-leading array), kv heads over tp."""
    return PQCache.partition_specs(jax.typeof(rows).sharding.spec[0], LOGICAL_AXES["kv_heads"])


def place_codebooks(codebooks: Codebooks, mesh: Mesh | None) -> tuple[jnp.ndarray | None, ...]:
    """Stacked centroids and encode weights (k_cent, v_cent, k_weights, v_weights; weights None unless
    weighted) on the model's mesh: per-kv-head ones (`[L, K, M, C, ds]`, `[L, K, D]`) split over tp,
    the others (`[L, M, C, ds]`, `[L, D]`) replicated; unchanged without a mesh."""
    arrays = (*codebooks.stacked(), *codebooks.stacked_weights())
    if mesh is None:
        return arrays
    heads = (None, LOGICAL_AXES["kv_heads"]) if codebooks.granularity == "layer_head" else ()
    sharding = NamedSharding(mesh, P(*heads))
    return tuple(None if x is None else put(x, sharding) for x in arrays)


def pq_decode_hidden(
    module: Llama,
    k_cent: jnp.ndarray,
    v_cent: jnp.ndarray,
    ids: jnp.ndarray,
    positions: jnp.ndarray,
    cache: PQCache,
    backend: str = "auto",
    recent: int | None = None,
    k_weights: jnp.ndarray | None = None,
    v_weights: jnp.ndarray | None = None,
) -> tuple[jnp.ndarray, PQCache]:
    """One decode step: ids/positions `[B, 1]`, stacked centroids `[L, (K,) M, C, ds]` (and encode
    weights `[L, (K,) D]`, if any) -> hidden `[B, 1, D]`, cache. `recent`: R, the window's recent slots
    (default all of them: a cache without pinned tokens)."""
    flush = partial(flush_full_rows, recent=recent)
    cache = per_kv_shard(flush, _cache_specs(cache.lengths), cache, k_cent, v_cent, k_weights, v_weights)
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
    recent: int,
    params,
    codebooks,
    cache: PQCache,
    logits,
    key,
    done,
    positions,
):
    """Choose the next token from `logits`, then run it through the model over the PQ cache;
    `codebooks`: the stacked centroids and encode weights (k_cent, v_cent, k_weights, v_weights)."""
    tok, done = choose_next(sampler, stop, pad_id, logits, key, done)
    module = model.merge(params)
    k_cent, v_cent, k_w, v_w = codebooks
    h, cache = pq_decode_hidden(
        module, k_cent, v_cent, tok[:, None], positions[:, None], cache, backend, recent, k_w, v_w
    )
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
    req = Request.parse(model, ids, params, attention_mask)
    model.check_length(req.ids.shape[1] + req.max_new_tokens)
    # the last OBSERVE prompt tokens choose the observed ones: a row of at most OBSERVE tokens has none
    observed = cache.observed if int(req.mask.sum(axis=1).max()) > OBSERVE else 0
    ids_p, mask_p = req.padded_prompt()
    capacity = bucket_length(ids_p.shape[1] + req.max_new_tokens + cache.window)  # a flush writes R slots
    exact = (cache.window, cache.keep_prompt_tail_exact, cache.sinks, observed)
    prefill, step = _compiled(model, capacity, exact, *req.static_key, cache.backend)
    codebooks = place_codebooks(cache.codebooks, model.mesh)  # centroids, weights (None unless weighted)

    weights = model.params  # gathered once: the parameter tree costs milliseconds to build per step
    t0 = time.perf_counter()
    logits, pq_cache = jax.block_until_ready(
        prefill(weights, codebooks, put_batch(ids_p, model.mesh), put_batch(mask_p, model.mesh))
    )
    if timings is not None:
        timings["prefill_s"] = time.perf_counter() - t0
    positions = jnp.asarray(req.mask.sum(axis=1), jnp.int32)

    def run(pq_cache, logits, key, done, i):
        return step(weights, codebooks, pq_cache, logits, key, done, positions + i)

    return req.decode(
        logits, pq_cache, run, progress=progress, desc="decode (pq)", timings=timings, stream=stream
    )


def _compiled(
    model: Model,
    capacity: int,
    exact: tuple[int, bool, int, int],
    sampler: tuple,
    stop: tuple,
    pad_id: int,
    backend: str,
):
    """Jitted PQ prefill and decode step for these static settings (cached on the model); `exact`: the
    window R, keep_prompt_tail_exact, sinks and observed of the `PQKV`."""
    fns = model.__dict__.setdefault("_pq_generate_fns", {})
    key = (capacity, exact, sampler, stop, pad_id, backend, llama.IN_PLACE_DECODE)
    window, keep_tail, sinks, observed = exact
    if key not in fns:

        def prefill(params, codebooks, ids, mask):
            k_cent, v_cent, k_w, v_w = codebooks
            module = model.merge(params)
            return pq_prefill(
                module, k_cent, v_cent, capacity, window, keep_tail, ids, mask, sinks, observed, k_w, v_w
            )

        step = partial(_decode_step, model, sampler, stop, pad_id, backend, window)
        fns[key] = (jax.jit(prefill), jax.jit(step, donate_argnums=(2,)))
    return fns[key]
