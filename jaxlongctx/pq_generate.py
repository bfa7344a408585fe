"""Generation over the PQ KV cache (MILLION): full-precision prefill, then lookup-table decode attention.

Prefill attends in full precision over the prompt, then encodes the prompt's K/V into a
preallocated `PQCache`. Each decode step flushes full windows (one batch), writes the new
token's exact K/V into the window and attends through `pallas_kernels.pq_decode_attention`.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlongctx.generate import Request, bucket_length, choose_next, last_real_index
from jaxlongctx.kvcache.calibrate import check_codebooks
from jaxlongctx.kvcache.codebooks import Codebooks
from jaxlongctx.kvcache.dense import dense_cache_bytes
from jaxlongctx.kvcache.pq_cache import (
    DEFAULT_WINDOW,
    PQCache,
    flush_full_rows,
    pq_cache_report,
    write_window,
)
from jaxlongctx.model.layers import DecoderLayer
from jaxlongctx.model.llama import Llama, forward_hidden
from jaxlongctx.model.model import Model
from jaxlongctx.sharding import LOGICAL_AXES, per_kv_shard, put, put_batch, sharded_pq_decode_attention
from jaxlongctx.validation import check_positive_int

KV_CACHES = ("dense", "pq")


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
    scale = module.config.head_dim**-0.5
    at = cache.window_lengths  # window slot of the new token, per row

    def body(layer: DecoderLayer, h, xs):
        k_codes, v_codes, k_win, v_win, kc, vc = xs  # one layer: [B K T M], [B K R D], [(K,) M C ds]
        q, k, v = layer.project_qkv(h, cos, sin)  # q [B 1 H D], k/v [B 1 K D]
        k_win, v_win = write_window(k_win, k[:, 0], at), write_window(v_win, v[:, 0], at)
        out = sharded_pq_decode_attention(
            q[:, 0], k_codes, v_codes, kc, vc, cache.lengths, k_win, v_win, at + 1, scale, backend=backend
        )  # [B H D]
        return layer.finish(h, out[:, None]), (k_win, v_win)

    xs = (cache.k_codes, cache.v_codes, cache.k_window, cache.v_window, k_cent, v_cent)
    h, (k_win, v_win) = module.scan_layers(body, module.embed_ids(ids), xs)
    return h, cache._replace(k_window=k_win, v_window=v_win, window_lengths=at + 1)


def _decode_step(
    model: Model,
    sampler: tuple,
    eos: tuple[int, ...],
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
    tok, done = choose_next(sampler, eos, pad_id, logits, key, done)
    module = model.merge(params)
    h, cache = pq_decode_hidden(module, k_cent, v_cent, tok[:, None], positions[:, None], cache, backend)
    return tok, done, module.head(h)[:, 0], cache


def check_pq_model(model: Any, codebooks: Any, window: int) -> int:
    """Validate a (model, codebooks, window) triple for PQ generation; returns the window."""
    if hasattr(model, "generate_ids"):
        raise ValueError(
            f"kv_cache='pq' applies to full-attention models; {type(model).__name__} keeps its own "
            "recurrent memory (use kv_cache='dense')"
        )
    if not isinstance(model, Model):
        raise ValueError(f"generate() needs a jaxlongctx Model, got {type(model).__name__}")
    if codebooks is None:
        raise ValueError("kv_cache='pq' needs codebooks= (see `jaxlongctx calibrate` and load_codebooks)")
    check_codebooks(model, codebooks)
    if codebooks.weighted:
        raise ValueError(
            "these codebooks weight channels (calibrated with --weighting attention); the PQ cache "
            "does not apply encode weights yet, so generate with codebooks calibrated without weighting"
        )
    return check_positive_int(window, "pq_window")


def generate_pq(
    model: Any,
    ids: Any,
    max_new_tokens: int,
    *,
    kv_cache: str = "pq",
    codebooks: Codebooks | None = None,
    window: int = DEFAULT_WINDOW,
    keep_prompt_tail_exact: bool = False,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_id: int | list[int] | None = None,
    attention_mask: Any = None,
    progress: bool = False,
    backend: str = "auto",
    timings: dict | None = None,
    stream: Any = None,
) -> np.ndarray:
    """`generate` with a PQ-compressed KV cache; same arguments and result (ids `[B, T + new]`)."""
    if kv_cache != "pq":
        raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
    window = check_pq_model(model, codebooks, window)
    req = Request.parse(
        model.config,
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_id=eos_id,
        attention_mask=attention_mask,
    )
    model.check_length(req.ids.shape[1] + req.max_new_tokens)
    ids_p, mask_p = req.padded_prompt()
    capacity = bucket_length(
        ids_p.shape[1] + req.max_new_tokens + window
    )  # a flush writes R slots at `lengths`
    prefill, step = _compiled(model, capacity, window, bool(keep_prompt_tail_exact), *req.static_key, backend)
    k_cent, v_cent = place_codebooks(*codebooks.stacked(), model.mesh)

    t0 = time.perf_counter()
    logits, cache = jax.block_until_ready(
        prefill(model.params, k_cent, v_cent, put_batch(ids_p, model.mesh), put_batch(mask_p, model.mesh))
    )
    if timings is not None:
        timings["prefill_s"] = time.perf_counter() - t0
    positions = jnp.asarray(req.mask.sum(axis=1), jnp.int32)

    def run(cache, logits, key, done, i):
        return step(model.params, k_cent, v_cent, cache, logits, key, done, positions + i)

    return req.decode(
        logits, cache, run, progress=progress, desc="decode (pq)", timings=timings, stream=stream
    )


def _compiled(
    model: Model,
    capacity: int,
    window: int,
    keep_tail: bool,
    sampler: tuple,
    eos: tuple,
    pad_id: int,
    backend: str,
):
    """Jitted PQ prefill and decode step for these static settings (cached on the model)."""
    fns = model.__dict__.setdefault("_pq_generate_fns", {})
    key = (capacity, window, keep_tail, sampler, eos, pad_id, backend)
    if key not in fns:

        def prefill(params, k_cent, v_cent, ids, mask):
            return pq_prefill(model.merge(params), k_cent, v_cent, capacity, window, keep_tail, ids, mask)

        fns[key] = (
            jax.jit(prefill),
            jax.jit(partial(_decode_step, model, sampler, eos, pad_id, backend), donate_argnums=(3,)),
        )
    return fns[key]


# --- CLI: generate --kv-cache pq -------------------------------------------------------------------
def add_kv_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV-cache options of `jaxlongctx generate` (and the demo)."""
    parser.add_argument("--kv-cache", choices=KV_CACHES, default="dense", help="decode cache (default dense)")
    parser.add_argument(
        "--codebooks", help="codebooks directory for --kv-cache pq (from `jaxlongctx calibrate`)"
    )
    parser.add_argument(
        "--pq-window",
        type=int,
        default=DEFAULT_WINDOW,
        help=f"exact recent tokens R of the PQ cache (default {DEFAULT_WINDOW})",
    )
    parser.add_argument(
        "--keep-prompt-tail-exact",
        action="store_true",
        help="keep the prompt's last tokens in the exact window instead of coding them all",
    )
    parser.add_argument(
        "--stats", action="store_true", help="print the KV cache bytes (vs dense bf16) as JSON"
    )


def kv_cache_kwargs(args: argparse.Namespace, model: Model) -> dict[str, Any]:
    """`generate` keyword arguments from the parsed KV-cache options (codebooks loaded and checked)."""
    if (args.kv_cache == "pq") != (args.codebooks is not None):
        raise ValueError("--codebooks is needed with --kv-cache pq, and only then")
    if args.kv_cache == "dense":
        return {}
    from jaxlongctx.kvcache.calibrate import load_codebooks_for

    return {
        "kv_cache": "pq",
        "codebooks": load_codebooks_for(model, args.codebooks),
        "pq_window": args.pq_window,
        "keep_prompt_tail_exact": args.keep_prompt_tail_exact,
    }


def cache_stats(model: Model, kwargs: dict[str, Any], tokens: int, batch: int = 1) -> dict[str, Any]:
    """Bytes of the KV cache `generate(**kwargs)` uses for `tokens` tokens per row, vs a dense bf16 cache."""
    if kwargs.get("kv_cache", "dense") == "dense":
        dense = dense_cache_bytes(model.config, tokens, batch)
        return {
            "kv_cache": "dense",
            "tokens": tokens,
            "batch": batch,
            "total_bytes": dense,
            "dense_bf16_bytes": dense,
        }
    report = pq_cache_report(
        model.config, kwargs["codebooks"], tokens, kwargs.get("pq_window", DEFAULT_WINDOW), batch
    )
    return {"kv_cache": "pq", **report}
