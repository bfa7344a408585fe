"""Prefill and decode throughput of jaxlongctx vs `transformers` on the same weights, same CPU, one run.

    python -m bench.prefill_decode [--quick]

Prefill: both sides generate one token through their public API (prompt forward + first token).
Decode: both sides start from the same filled cache and run `--new-tokens` greedy steps, timed on
their own: our jitted decode step over the static cache, `transformers`' forward with its dynamic
cache (cropped back to the prompt after every repeat). Medians of interleaved repeats after a
warm-up; our compile time is reported separately.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import jaxlongctx
from bench.common import interleaved_times, plot_path, save_plot, subplots, use_quick_results, write_result
from convert.hf_llama import export_ckpt_to_hf
from jaxlongctx.checkpoint import save_model
from jaxlongctx.config import ModelConfig
from jaxlongctx.decode_loop import Request, bucket_length
from jaxlongctx.generate import _compiled

CONFIG = ModelConfig(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=500000.0,
    max_position_embeddings=65536,
)


def main() -> None:
    """Run the sweep and write bench/results/prefill_decode.{json,png}."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1K and 4K contexts only, fewer repeats")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    use_quick_results(args.quick)
    import torch
    import transformers

    contexts = [1024, 4096] if args.quick else [1024, 4096, 16384]
    repeats = 2 if args.quick else 5
    n = args.new_tokens
    model = jaxlongctx.Model.init(CONFIG, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model.module, Path(tmp) / "ckpt")
        export_ckpt_to_hf(Path(tmp) / "ckpt", Path(tmp) / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32).eval()

    def ours_prefill(ids):
        return lambda: jaxlongctx.generate(model, ids, jaxlongctx.SamplingParams(1, stop_ids=()))

    def theirs_prefill(ids):
        t = torch.tensor(ids, dtype=torch.long)

        def run():
            with torch.no_grad():
                return hf.generate(
                    t, max_new_tokens=1, min_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0
                )

        return run

    rows = []
    for ctx in contexts:
        ids = np.random.default_rng(ctx).integers(3, CONFIG.vocab_size, (1, ctx)).astype(np.int32)
        t = interleaved_times({"ours": ours_prefill(ids), "hf": theirs_prefill(ids)}, repeats=repeats)
        decode = decode_times(model, hf, ids, n, repeats)
        row = {
            "context": ctx,
            "ours_prefill_tokens_per_s": ctx / t["ours"]["median_s"],
            "hf_prefill_tokens_per_s": ctx / t["hf"]["median_s"],
            "ours_decode_tokens_per_s": n / decode["ours"],
            "hf_decode_tokens_per_s": n / decode["hf"],
            "ours_compile_and_first_prefill_s": t["ours"]["first_call_s"],
            "raw_prefill_times": t,
            "decode_median_s": decode,
        }
        row["prefill_ratio"] = row["ours_prefill_tokens_per_s"] / row["hf_prefill_tokens_per_s"]
        row["decode_ratio"] = row["ours_decode_tokens_per_s"] / row["hf_decode_tokens_per_s"]
        rows.append(row)
        print(
            f"ctx {ctx:6d}: prefill {row['ours_prefill_tokens_per_s']:8.0f} vs {row['hf_prefill_tokens_per_s']:8.0f} "
            f"tok/s (x{row['prefill_ratio']:.2f}); decode {row['ours_decode_tokens_per_s']:6.1f} vs "
            f"{row['hf_decode_tokens_per_s']:6.1f} tok/s (x{row['decode_ratio']:.2f})",
            flush=True,
        )
    write_result(
        "prefill_decode",
        {
            "config": CONFIG.to_dict(),
            "quick": args.quick,
            "new_tokens": n,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "results": rows,
        },
    )
    _plot(rows)


def decode_times(model, hf, ids: np.ndarray, n: int, repeats: int, peers=None) -> dict[str, float]:
    """Median seconds for `n` greedy decode steps from a filled cache, ours and `transformers`' side by side,
    and those of `peers` (name -> a call that runs the `n` steps and returns its seconds) in the same rounds."""
    import jax
    import jax.numpy as jnp
    import torch

    req = Request.parse(model, ids, jaxlongctx.SamplingParams(n, stop_ids=()), None)
    ids_p, mask_p = req.padded_prompt()
    prefill, step = _compiled(model, bucket_length(ids_p.shape[1] + n), *req.static_key)
    weights = model.params  # gathered once, as generate does
    logits0, cache0 = prefill(weights, jnp.asarray(ids_p), jnp.asarray(mask_p))
    pos0, slot0 = ids.shape[1], ids_p.shape[1]
    key, done = jax.random.key(0), jnp.zeros((1,), bool)
    if hf is not None:  # None: ours and the peers only
        with torch.no_grad():
            first = hf(input_ids=torch.tensor(ids, dtype=torch.long), use_cache=True)
        pkv, tok0 = first.past_key_values, first.logits[:, -1:].argmax(-1)

    def ours() -> float:
        cache, logits = jax.tree.map(jnp.copy, cache0), logits0  # the step donates its cache
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        for i in range(n):
            _, _, logits, cache = step(
                weights, cache, logits, key, done, jnp.array([pos0 + i], jnp.int32), jnp.int32(slot0 + i)
            )
        jax.block_until_ready(logits)
        return time.perf_counter() - t0

    def theirs() -> float:
        tok = tok0
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(n):
                tok = hf(input_ids=tok, past_key_values=pkv, use_cache=True).logits[:, -1:].argmax(-1)
        elapsed = time.perf_counter() - t0
        pkv.crop(-n)  # back to the prompt for the next repeat
        return elapsed

    runs = {"ours": ours, **({"hf": theirs} if hf is not None else {}), **(peers or {})}
    for run in runs.values():  # warm-up (compiles our step)
        run()
    samples = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(run())
    return {k: statistics.median(v) for k, v in samples.items()}


def _plot(rows: list[dict]) -> None:
    ctx = [r["context"] for r in rows]
    fig, axes = subplots(1, 2, figsize=(10, 4))
    for ax, kind in zip(axes, ("prefill", "decode")):
        ax.plot(ctx, [r[f"ours_{kind}_tokens_per_s"] for r in rows], "o-", label="jaxlongctx")
        ax.plot(ctx, [r[f"hf_{kind}_tokens_per_s"] for r in rows], "s--", label="transformers (torch CPU)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{kind} throughput")
        ax.legend()
    save_plot(fig, plot_path("prefill_decode"), dpi=100)


if __name__ == "__main__":
    main()
