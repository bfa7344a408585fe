"""Seconds per step of memory-only ARMT fine-tuning on SmolLM2-135M-Instruct, per configuration.

Each configuration (segment size, memory tokens, d_mem, segments per sample, batch, remat, base dtype)
runs `jaxlongctx train-armt`'s trainer (`prepare_train_armt`: chat haystacks, the base frozen) in its
own process: one warm-up step (compilation), then timed steps on new batches; the median step time,
the process's peak RSS and the load average before and after are recorded. The bf16 matmul FLOP/s of
this machine is measured in the same run (`bench.device_limits`), and each row gives the fraction of it
that its step reaches, counting `6 N T` FLOPs per step (N parameters, T tokens: the forward, the
recomputed forward and the input-gradient backward; attention scores and memory updates left out).

    python -m bench.armt_finetune_steps [--quick]

`--quick`: two small configurations, written to `armt_finetune_steps_quick.*`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import jax

from bench.common import save_plot, subplots, use_quick_results, write_result
from bench.device_limits import matmul_flops

NAME = "armt_finetune_steps"
BASE = ["--base", "smollm2", "--freeze-base", "--chat", "--lr", "1e-4", "--no-progress"]


def config(
    segment: int, mem: int, segments: int, batch: int = 1, remat: bool = True, base_dtype: str = "bf16"
) -> dict[str, Any]:
    """One configuration to time (d_mem 64 throughout)."""
    return {
        "segment_size": segment,
        "mem_tokens": mem,
        "d_mem": 64,
        "segments": segments,
        "batch": batch,
        "remat": remat,
        "base_dtype": base_dtype,
    }


FULL = [
    config(512, 16, 2),
    config(512, 16, 4),
    config(512, 16, 8),
    config(512, 32, 4),
    config(1024, 16, 2),
    config(1024, 16, 4),
    config(512, 16, 2, batch=2),
    config(512, 16, 4, remat=False),
    config(512, 16, 4, base_dtype="fp32"),
]
QUICK = [config(64, 16, 2), config(64, 16, 2, remat=False)]


def time_one(cfg: dict[str, Any], timed_steps: int) -> dict[str, Any]:
    """Build the trainer of `cfg`, run one warm-up and `timed_steps` timed steps (in this process)."""
    from jaxlongctx.commands.train_armt import add_train_armt_arguments, prepare_train_armt

    tokens = cfg["segment_size"] * cfg["segments"]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="armt-steps-") as out:
        words = [
            *BASE,
            "--out",
            out,
            "--segment-size",
            str(cfg["segment_size"]),
            "--mem-tokens",
            str(cfg["mem_tokens"]),
            "--d-mem",
            str(cfg["d_mem"]),
            "--base-dtype",
            cfg["base_dtype"],
            "--curriculum",
            f"{tokens}:{1 + timed_steps}:{cfg['batch']}",
            "--ckpt-every",
            "1000",
            *(["--remat"] if cfg["remat"] else []),
        ]
        parser = argparse.ArgumentParser()
        add_train_armt_arguments(parser)
        run = prepare_train_armt(parser.parse_args(words))
        history = run.trainer.run()
        params = sum(x.size for x in jax.tree.leaves((run.trainer.params, run.trainer.frozen)))
    wall = [0.0, *history["wall_s"]]
    steps = [b - a for a, b in itertools.pairwise(wall)]
    return {
        **cfg,
        "tokens_per_sample": tokens,
        "parameters": int(params),
        "first_step_s": steps[0],
        "step_s": steps[1:],
        "median_step_s": statistics.median(steps[1:]),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "losses": history["loss"],
    }


def main() -> None:
    """Entry point: time every configuration in a child process, then write JSON and PNG."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small configurations (a smoke run)")
    parser.add_argument("--timed-steps", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: time one configuration (JSON)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(time_one(json.loads(args.one), args.timed_steps)), flush=True)
        return
    use_quick_results(args.quick)
    ceiling = max(r["flops_per_s"] for r in matmul_flops((1024, 2048), repeats=5))
    rows = []
    for cfg in QUICK if args.quick else FULL:
        cmd = [sys.executable, "-m", "bench.armt_finetune_steps", "--one", json.dumps(cfg)]
        cmd += ["--timed-steps", str(args.timed_steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:  # a negative code is a signal (-9: killed, e.g. for memory)
            rows.append({**cfg, "returncode": proc.returncode, "error": proc.stderr[-2000:]})
        else:
            row = json.loads(lines[-1].removeprefix("RESULT "))
            flops = 6 * row["parameters"] * row["tokens_per_sample"] * row["batch"]
            row["flops_per_step"] = flops
            row["fraction_of_matmul_ceiling"] = flops / row["median_step_s"] / ceiling
            rows.append(row)
        print(json.dumps({k: rows[-1].get(k) for k in ("segment_size", "segments", "median_step_s")}))
        write_result(NAME, {"bf16_matmul_flops_per_s": ceiling, "rows": rows, "complete": False})
    write_result(NAME, {"bf16_matmul_flops_per_s": ceiling, "rows": rows, "complete": True})
    plot(rows)


def plot(rows: list[dict[str, Any]]) -> None:
    """Median seconds per step against tokens per step, one point per configuration."""
    from bench.common import plot_path

    fig, ax = subplots(figsize=(7, 4))
    for row in rows:
        if "median_step_s" not in row:
            continue
        label = (
            f"S{row['segment_size']} M{row['mem_tokens']} x{row['segments']} b{row['batch']}"
            f"{'' if row['remat'] else ' no-remat'}{' fp32' if row['base_dtype'] == 'fp32' else ''}"
        )
        x = row["tokens_per_sample"] * row["batch"]
        ax.scatter(x, row["median_step_s"])
        ax.annotate(label, (x, row["median_step_s"]), fontsize=7)
    ax.set_xlabel("tokens per step")
    ax.set_ylabel("median seconds per step")
    ax.set_title("SmolLM2 memory-only ARMT fine-tuning, 2 CPU cores (shared)")
    ax.grid(alpha=0.3)
    save_plot(fig, plot_path(NAME))


if __name__ == "__main__":
    main()
