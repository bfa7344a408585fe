"""Perplexity with every token's K/V fake-quantized: dense vs PQ (ds 2/4 x codebook granularity) vs KIVI int4/int2.

Codebooks are calibrated on the calibration split, perplexity is measured on the validation
split (kept apart, unlike the MILLION reference). Writes bench/results/pq_quality.json + .png.

    python -m bench.pq_quality [--ckpt DIR] [--quick]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import plot_path, repo_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.demo import BASE_MODEL


def main(argv: list[str] | None = None) -> dict:
    """Run the table and write the result files."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ckpt", default=str(BASE_MODEL), help="model to evaluate (default: the shipped base model)"
    )
    p.add_argument(
        "--dtype", choices=["bf16", "fp32"], default="fp32", help="evaluation dtype (default fp32)"
    )
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--eval-tokens", type=int, default=None, help="validation tokens used (default: all)")
    p.add_argument("--calib-tokens", type=int, default=16384)
    p.add_argument("--bits", type=int, default=8)
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--kivi-group", type=int, default=128)
    p.add_argument(
        "--quick", action="store_true", help="few tokens and iterations (a smoke run, not a result)"
    )
    p.add_argument("--name", default="pq_quality", help="result name (bench/results/<name>.json)")
    args = p.parse_args(argv)
    use_quick_results(args.quick)

    from jaxlongctx.data.tokenizer import encode_corpus
    from jaxlongctx.kv_quality import kv_perplexity
    from jaxlongctx.kvcache.calibrate import calibrate
    from jaxlongctx.loading import load

    if not Path(args.ckpt).exists():
        raise SystemExit(
            f"model {args.ckpt} does not exist (a random model's perplexities would be meaningless)"
        )
    if args.quick:
        args.eval_tokens, args.calib_tokens, args.iters = 4 * args.context, 2 * args.context, 3
    model = load(args.ckpt, args.dtype)
    calib = encode_corpus("calibration", model.tokenizer)
    val = encode_corpus("validation", model.tokenizer)[: args.eval_tokens]
    seq_len = min(args.context, 512)
    rows = []

    def record(row: dict, seconds: float) -> None:
        row["seconds"] = round(seconds, 1)
        rows.append(row)
        print(
            {k: row[k] for k in ("kv", "ds", "granularity", "bits_per_element", "ppl") if k in row},
            flush=True,
        )

    t0 = time.perf_counter()
    record(kv_perplexity(model, val, args.context, "dense"), time.perf_counter() - t0)
    for kind in ("int4", "int2"):
        t0 = time.perf_counter()
        record(kv_perplexity(model, val, args.context, kind, group=args.kivi_group), time.perf_counter() - t0)
    for ds in (2, 4):
        for granularity in ("shared", "layer", "layer_head"):
            t0 = time.perf_counter()
            cb = calibrate(
                model,
                calib,
                ds,
                args.bits,
                granularity,
                args.iters,
                seq_len=seq_len,
                max_tokens=args.calib_tokens,
                source="calibration split",
            )
            row = kv_perplexity(model, val, args.context, "pq", cb)
            row.update(key_mse=cb.metadata["key_mse"], value_mse=cb.metadata["value_mse"])
            record(row, time.perf_counter() - t0)
    dense = rows[0]["ppl"]
    for row in rows:
        row["ppl_vs_dense"] = row["ppl"] / dense
    payload = {
        "config": {
            "ckpt": repo_path(args.ckpt),
            "dtype": args.dtype,
            "context": args.context,
            "eval_tokens": rows[0]["tokens"],
            "calib_tokens": args.calib_tokens,
            "bits": args.bits,
            "kmeans_iters": args.iters,
            "kivi_group": args.kivi_group,
            "quick": args.quick,
            "model_config": model.config.to_dict(),
            "protocol": "every token's post-RoPE K/V fake-quantized in every layer; calibration split "
            "for codebooks, validation split for perplexity",
        },
        "rows": rows,
    }
    write_result(args.name, payload)
    _plot(rows, plot_path(args.name))
    return payload


def _label(row: dict) -> str:
    """Short name of a table row."""
    if row["kv"] == "pq":
        return f"pq ds{row['ds']} {row['granularity']}"
    return row["kv"] + (f" g{row['group']}" if "group" in row else "")


def _plot(rows: list[dict], path: Path) -> None:
    """Bar chart of perplexity per K/V format, annotated with bits per element."""
    fig, ax = subplots(figsize=(9, 4))
    labels = [_label(r) for r in rows]
    ppl = [r["ppl"] for r in rows]
    colors = [
        "gray" if r["kv"] == "dense" else "tab:orange" if r["kv"].startswith("int") else "tab:blue"
        for r in rows
    ]
    bars = ax.bar(range(len(rows)), ppl, color=colors)
    for bar, r in zip(bars, rows):
        ax.text(
            bar.get_x() + bar.get_width() / 2,
            bar.get_height(),
            f"{r['bits_per_element']:.2g}b",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.axhline(rows[0]["ppl"] * 1.04, color="gray", ls="--", lw=1, label="dense +4%")
    ax.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("validation perplexity")
    ax.set_title("K/V fake quantization: perplexity (label: stored bits per element)")
    ax.legend()
    save_plot(fig, path, dpi=120)


if __name__ == "__main__":
    main()
