"""Wall time of `jaxlongctx calibrate` on SmolLM2-135M-Instruct at every granularity, ds 2 and 4.

    python -m bench.pq_calibration_time [--quick] [--seq-len 512] [--max-tokens 16384]

Each row is one `calibrate(...)` call with the command's defaults (8-bit codes, 25 iterations at
most, stop when the error falls by under 1e-3 in an iteration, 64 sampled vectors per centroid) on
the calibration split: collecting the post-RoPE keys and values, then the k-means of every layer
and subspace. Compilation is part of each call, as it is for a user. The load average before and
after each row is recorded: the goal (under 2 minutes at every granularity on 2 cores) is meant for
a quiet machine. Writes bench/results/pq_calibration_time.{json,png} (`--quick`: one small row, to
_quick files).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import jaxlongctx
from bench.common import environment, plot_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.data.tokenizer import encode_corpus
from jaxlongctx.kvcache.calibrate import calibrate
from jaxlongctx.kvcache.codebooks import GRANULARITIES
from jaxlongctx.pretrained import smollm2_gguf

GOAL_SECONDS = 120.0
SETTINGS = {"bits": 8, "iters": 25, "points_per_centroid": 64, "tol": 1e-3}  # the command's defaults
QUICK = {"rows": [(2, "shared")], "max_tokens": 1024}


def time_row(model: Any, tokens: Any, ds: int, granularity: str, seq_len: int, max_tokens: int) -> dict:
    """One timed calibration."""
    before = os.getloadavg()[0]
    start = time.perf_counter()
    cb = calibrate(
        model,
        tokens,
        ds,
        SETTINGS["bits"],
        granularity,
        SETTINGS["iters"],
        seq_len=seq_len,
        max_tokens=max_tokens,
        points_per_centroid=SETTINGS["points_per_centroid"],
        tol=SETTINGS["tol"],
        source="calibration split",
    )
    seconds = time.perf_counter() - start
    row = {"ds": ds, "granularity": granularity, "seconds": seconds, "load_average_before": before}
    row["load_average_after"] = os.getloadavg()[0]
    for field in ("calibration_tokens", "iters_run", "key_mse", "value_mse"):  # what the time bought
        row[field] = cb.metadata.get(field)
    print(
        f"ds {ds} {granularity:<10} {seconds:7.1f} s (load {before:.1f}), {row['iters_run']} iterations, "
        f"k/v error {row['key_mse']:.4g} / {row['value_mse']:.4g}",
        flush=True,
    )
    return row


def plot(payload: dict[str, Any], name: str) -> str:
    """Bars of seconds per row, the goal marked."""
    fig, ax = subplots(figsize=(7, 3.5))
    rows = payload["rows"]
    labels = [f"ds {r['ds']}\n{r['granularity']}" for r in rows]
    ax.bar(
        labels,
        [r["seconds"] for r in rows],
        color=["tab:blue" if r["ds"] == 2 else "tab:orange" for r in rows],
    )
    ax.axhline(GOAL_SECONDS, color="gray", ls="--", label="goal: 2 minutes")
    ax.set_ylabel("wall seconds (2 CPU cores)")
    ax.set_title("SmolLM2-135M: PQ calibration time, 8-bit codes")
    ax.legend()
    return str(save_plot(fig, plot_path(name)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=512, help="calibration window (default 512)")
    p.add_argument("--max-tokens", type=int, default=16384, help="calibration tokens (default 16384)")
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}, written to _quick files")
    args = p.parse_args(argv)
    use_quick_results(args.quick)
    model = jaxlongctx.load(smollm2_gguf(), "fp32")
    tokens = encode_corpus("calibration", model.tokenizer)
    rows_to_run = QUICK["rows"] if args.quick else [(ds, g) for ds in (2, 4) for g in GRANULARITIES]
    max_tokens = QUICK["max_tokens"] if args.quick else args.max_tokens
    payload: dict[str, Any] = {
        "name": "pq_calibration_time",
        "environment": environment(),
        "settings": {**SETTINGS, "seq_len": args.seq_len, "max_tokens": max_tokens, "dtype": "fp32"},
        "goal_seconds": GOAL_SECONDS,
        "quick": args.quick,
        "rows": [],
    }
    for ds, granularity in rows_to_run:
        payload["rows"].append(time_row(model, tokens, ds, granularity, args.seq_len, max_tokens))
        write_result("pq_calibration_time", payload)
    payload["plot"] = plot(payload, "pq_calibration_time")
    write_result("pq_calibration_time", payload)


if __name__ == "__main__":
    main()
