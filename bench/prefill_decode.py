"""Prefill and decode throughput of jaxlongctx vs `transformers` on the same weights, same CPU, one run.

    python bench/prefill_decode.py [--quick]

Both sides run greedy generation through their public API: prefill time = generate 1 token;
decode tokens/s = extra tokens / (time to generate 1 + n tokens - prefill time). Medians of
interleaved repeats after a warm-up; our compile time is reported separately.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import interleaved_times, plot_path, write_result  # noqa: E402

import jaxlongctx  # noqa: E402
from convert.hf_llama import export_ckpt_to_hf  # noqa: E402
from jaxlongctx.checkpoint import save_model  # noqa: E402
from jaxlongctx.config import ModelConfig  # noqa: E402

CONFIG = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                     num_kv_heads=2, head_dim=64, rope_theta=500000.0, max_position_embeddings=65536)


def main() -> None:
    """Run the sweep and write bench/results/prefill_decode.{json,png}."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1K and 4K contexts only, fewer repeats")
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args()
    import torch
    import transformers

    contexts = [1024, 4096] if args.quick else [1024, 4096, 16384]
    repeats = 2 if args.quick else 3
    n = args.new_tokens
    model = jaxlongctx.Model.init(CONFIG, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model.module, Path(tmp) / "ckpt")
        export_ckpt_to_hf(Path(tmp) / "ckpt", Path(tmp) / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32).eval()

    def ours(ids, new):
        return lambda: jaxlongctx.generate(model, ids, new, eos_id=-1)

    def theirs(ids, new):
        t = torch.tensor(ids, dtype=torch.long)

        def run():
            with torch.no_grad():
                return hf.generate(t, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
        return run

    rows = []
    for ctx in contexts:
        ids = np.random.default_rng(ctx).integers(3, CONFIG.vocab_size, (1, ctx)).astype(np.int32)
        t = interleaved_times({"ours_prefill": ours(ids, 1), "ours_gen": ours(ids, 1 + n),
                               "hf_prefill": theirs(ids, 1), "hf_gen": theirs(ids, 1 + n)}, repeats=repeats)
        row = {"context": ctx}
        for side in ("ours", "hf"):
            pre, gen = t[f"{side}_prefill"]["median_s"], t[f"{side}_gen"]["median_s"]
            row[f"{side}_prefill_tokens_per_s"] = ctx / pre
            row[f"{side}_decode_tokens_per_s"] = n / max(gen - pre, 1e-9)
        row["ours_compile_and_first_prefill_s"] = t["ours_prefill"]["first_call_s"]
        row["prefill_ratio"] = row["ours_prefill_tokens_per_s"] / row["hf_prefill_tokens_per_s"]
        row["decode_ratio"] = row["ours_decode_tokens_per_s"] / row["hf_decode_tokens_per_s"]
        row["raw_times"] = t
        rows.append(row)
        print(f"ctx {ctx:6d}: prefill {row['ours_prefill_tokens_per_s']:8.0f} vs {row['hf_prefill_tokens_per_s']:8.0f} "
              f"tok/s (x{row['prefill_ratio']:.2f}); decode {row['ours_decode_tokens_per_s']:6.1f} vs "
              f"{row['hf_decode_tokens_per_s']:6.1f} tok/s (x{row['decode_ratio']:.2f})")
    write_result("prefill_decode", {"config": CONFIG.to_dict(), "quick": args.quick, "new_tokens": n,
                                    "torch": torch.__version__, "transformers": transformers.__version__,
                                    "torch_threads": torch.get_num_threads(), "results": rows})
    _plot(rows)


def _plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = [r["context"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind in zip(axes, ("prefill", "decode")):
        ax.plot(ctx, [r[f"ours_{kind}_tokens_per_s"] for r in rows], "o-", label="jaxlongctx")
        ax.plot(ctx, [r[f"hf_{kind}_tokens_per_s"] for r in rows], "s--", label="transformers (torch CPU)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{kind} throughput")
        ax.legend()
    fig.tight_layout()
    fig.savefig(plot_path("prefill_decode"), dpi=100)


if __name__ == "__main__":
    main()
