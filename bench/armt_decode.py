"""ARMT generation vs full-attention generation after prompts of growing length, side by side in one run.

    python -m bench.armt_decode [--quick] [--new-tokens N]

Both sides run the public `jaxlongctx.generate` (greedy, no early stop) on the shipped models: the
ARMT model on the diagonal schedule and the base model it was fine-tuned from with a dense KV cache.
Each reports prefill seconds (ARMT: the prompt's segments and its decoding window) and decode
seconds (ARMT: window commits included), medians of interleaved repeats after a warm-up. Memory:
ARMT's recurrent state plus its 2S-slot window cache against the dense cache full attention
allocates, both in the run's dtype. Writes bench/results/armt_decode.{json,png}.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.common import plot_path, repo_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.decode_loop import bucket_length
from jaxlongctx.demo import ARMT_MODEL, BASE_MODEL
from jaxlongctx.generate import generate
from jaxlongctx.kvcache.dense import dense_cache_bytes
from jaxlongctx.loading import load
from jaxlongctx.sampling import SamplingParams

DTYPE_BYTES = 4  # both models run in fp32 here


def timed_generation(model: Any, ids: np.ndarray, new_tokens: int) -> dict[str, float]:
    """Prefill and decode seconds of one greedy generation of exactly `new_tokens`."""
    timings: dict[str, float] = {}
    generate(model, ids, SamplingParams(new_tokens, stop_ids=()), timings=timings)
    if timings["decode_steps"] != new_tokens:
        raise RuntimeError(f"expected {new_tokens} decode steps, got {timings['decode_steps']}")
    return timings


def measure(models: dict[str, Any], context: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    """Interleaved repeats of both generations after one `context`-token prompt."""
    vocab = min(m.config.vocab_size for m in models.values())
    ids = np.random.default_rng(context).integers(3, vocab, (1, context)).astype(np.int32)
    first = {name: timed_generation(m, ids, new_tokens) for name, m in models.items()}  # compile
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, m in models.items():
            runs[name].append(timed_generation(m, ids, new_tokens))
    row: dict[str, Any] = {"context": context}
    for name, ts in runs.items():
        prefill = statistics.median(t["prefill_s"] for t in ts)
        decode = statistics.median(t["decode_s"] for t in ts)
        row[name] = {
            "prefill_s": prefill,
            "decode_s": decode,
            "prefill_tokens_per_s": context / prefill,
            "decode_tokens_per_s": new_tokens / decode,
            "first_call_s": first[name]["prefill_s"] + first[name]["decode_s"],
            "repeats": repeats,
        }
    row["decode_speedup_armt_vs_full"] = row["full_attention"]["decode_s"] / row["armt"]["decode_s"]
    row["prefill_speedup_armt_vs_full"] = row["full_attention"]["prefill_s"] / row["armt"]["prefill_s"]
    return row


def memory_bytes(armt: Any, base: Any, context: int, new_tokens: int) -> dict[str, int]:
    """Decoding memory: ARMT state + window cache, and the dense cache full attention allocates."""
    window = 2 * armt.armt.segment_size
    capacity = bucket_length(bucket_length(context) + new_tokens)  # as `generate` sizes it
    return {
        "armt_state": armt.state_bytes(),
        "armt_window_cache": dense_cache_bytes(armt.config, window, itemsize=DTYPE_BYTES),
        "full_attention_cache": dense_cache_bytes(base.config, capacity, itemsize=DTYPE_BYTES),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1K and 4K prompts, 2 repeats")
    p.add_argument(
        "--new-tokens",
        type=int,
        default=256,
        help="tokens generated per run (default 256: crosses ARMT's first window commit)",
    )
    p.add_argument("--armt-ckpt", default=str(ARMT_MODEL))
    p.add_argument("--base-ckpt", default=str(BASE_MODEL))
    args = p.parse_args()
    use_quick_results(args.quick)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2")
    contexts = [1024, 4096] if args.quick else [1024, 4096, 16384, 32768]
    repeats = 2 if args.quick else 3
    armt, base = load(args.armt_ckpt, "fp32"), load(args.base_ckpt, "fp32")
    models = {"armt": armt, "full_attention": base}
    rows = []
    for context in tqdm(contexts, desc="prompt lengths", unit="len"):
        row = measure(models, context, args.new_tokens, repeats)
        row["memory_bytes"] = memory_bytes(armt, base, context, args.new_tokens)
        rows.append(row)
        armt_tps, full_tps = (row[n]["decode_tokens_per_s"] for n in models)
        tqdm.write(
            f"{context:6d} tokens: decode ARMT {armt_tps:6.1f} tok/s, full {full_tps:6.1f} tok/s "
            f"(x{row['decode_speedup_armt_vs_full']:.2f}); prefill x{row['prefill_speedup_armt_vs_full']:.2f}"
        )
    write_result(
        "armt_decode",
        {
            "armt_ckpt": repo_path(args.armt_ckpt),
            "base_ckpt": repo_path(args.base_ckpt),
            "quick": args.quick,
            "new_tokens": args.new_tokens,
            "schedule": "diagonal",
            "dtype": "float32",
            "results": rows,
            "plot": "armt_decode.png",
        },
    )

    fig, (ax_t, ax_m) = subplots(1, 2, figsize=(11, 4))
    for name, label in (("armt", "ARMT (diagonal)"), ("full_attention", "full attention")):
        ax_t.plot(contexts, [r[name]["decode_tokens_per_s"] for r in rows], "o-", label=label)
    ax_t.set_ylabel(f"decode tokens/s ({args.new_tokens} new, batch 1)")
    ax_m.plot(
        contexts,
        [r["memory_bytes"]["armt_state"] + r["memory_bytes"]["armt_window_cache"] for r in rows],
        "o-",
        label="ARMT state + window cache",
    )
    ax_m.plot(
        contexts,
        [r["memory_bytes"]["full_attention_cache"] for r in rows],
        "o-",
        label="full-attention KV cache",
    )
    ax_m.set_yscale("log")
    ax_m.set_ylabel("decoding memory (bytes, fp32)")
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Generation after a long prompt: ARMT vs full attention (same architecture, CPU)")
    save_plot(fig, plot_path("armt_decode"), dpi=110)


if __name__ == "__main__":
    main()
