"""ARMT schedules vs full attention: wall time against input length, working memory, compile time
and ramp waste, all measured side by side in one run.

    python -m bench.armt_schedule [--quick]

On CPU: an 8-layer d=256 model, lengths 1K..32K (quick: 1K..8K), segment sizes 128..1024 with
16..128 memory tokens. With a GPU present the same script runs the GPU sweep unchanged: the
Llama-3.2-1B shape in bf16, segment 1024, 128 memory tokens, 16K..131K tokens.
`--sweep device` (bench/device_run.py, a few minutes of a lent GPU) times only ARMT at that shape,
diagonal with the vmapped cell and with the grouped-GEMM kernel against sequential, and writes the
JSON after every length; `--sweep device_dry_run` runs the same on a tiny model on CPU.
`--sweep published_device` times the ARMT authors' published cell (sink, sliding window over the
previous segment, 32 memory tokens, segment 1024, llama3 RoPE; spec/armt_published.md) at the same
shape against sequential and full attention, with the state bytes per row; `--published` runs it at a
small shape on CPU (bench/results/armt_published_schedule.json).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import interleaved_times, plot_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.armt import ARMTConfig, ARMTModel
from jaxlongctx.armt.cpu_execution import PIPELINE_ALWAYS, batch_cells, diagonal_pays_off
from jaxlongctx.armt.diagonal import computed_cells, empty_pipeline, fixed_buffer_waste, plan, run_block
from jaxlongctx.armt.memory import zero_state
from jaxlongctx.armt.segments import Segments
from jaxlongctx.config import ModelConfig
from jaxlongctx.demo import peak_rss_bytes
from jaxlongctx.model.model import Model

CPU_MODEL = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=688,
    num_layers=8,
    num_heads=4,
    num_kv_heads=4,
    head_dim=64,
)
# Llama-3.2-1B shape; vocab cut to 8192 so that float32 logits of 131K tokens fit in memory.
GPU_MODEL = dict(
    vocab_size=8192,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
)
# the published checkpoints' base (Llama-3.2-1B, spec/armt_published.md 6), vocab cut as above
PUBLISHED_GPU_MODEL = dict(
    GPU_MODEL,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=True,
)
# the published cell (jaxlongctx.convert.armt_hf.published_armt_config without the file)
PUBLISHED_CELL = dict(sink=True, sliding_window=True, normalize_features=True, gamma_eps=0.0)
TINY_MODEL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
# Diagonal projections timed side by side in the device sweeps (jaxlongctx.armt.projections).
DEVICE_PROJECTIONS = ("vmap", "grouped_matmul")
DEVICE_DRY_RUN = dict(
    model=TINY_MODEL,
    dtype="float32",
    lengths=[64],
    armt=[(16, 4)],
    repeats=1,
    full=False,
    projections=DEVICE_PROJECTIONS,
    kernel="xla",
    pipeline_on_cpu=True,
)
SWEEPS = {
    "cpu": dict(
        model=CPU_MODEL,
        dtype="float32",
        lengths=[1024, 2048, 4096, 8192, 16384, 32768],
        armt=[(128, 16), (256, 32), (512, 64), (1024, 128)],
        repeats=3,
    ),
    "cpu_quick": dict(
        model=CPU_MODEL,
        dtype="float32",
        lengths=[1024, 2048, 4096, 8192],
        armt=[(128, 16), (512, 64), (1024, 128)],
        repeats=3,
    ),
    "gpu": dict(
        model=GPU_MODEL,
        dtype="bfloat16",
        lengths=[16384, 32768, 65536, 131072],
        armt=[(1024, 128), (512, 128)],
        repeats=5,
    ),
    # no full attention and no memory analysis: these fit the device run's time box
    "device": dict(
        model=GPU_MODEL,
        dtype="bfloat16",
        lengths=[16384, 32768, 65536, 131072],
        armt=[(1024, 128)],
        repeats=3,
        full=False,
        projections=DEVICE_PROJECTIONS,
        kernel="auto",
    ),
    "published_device": dict(
        model=PUBLISHED_GPU_MODEL,
        dtype="bfloat16",
        lengths=[16384, 32768, 65536, 131072],
        armt=[(1024, 32)],
        cell=PUBLISHED_CELL,
        repeats=2,
        full=True,
        full_memory=False,  # no compile-time memory analysis: it would not fit the device run's time box
        projections=DEVICE_PROJECTIONS,
        kernel="auto",
    ),
    "device_dry_run": DEVICE_DRY_RUN,
    "published_device_dry_run": dict(DEVICE_DRY_RUN, cell=PUBLISHED_CELL, full=True, full_memory=False),
    "published_cpu": dict(
        model=CPU_MODEL,
        dtype="float32",
        lengths=[1024, 2048, 4096, 8192],
        armt=[(256, 32)],
        cell=PUBLISHED_CELL,
        repeats=3,
    ),
}


def compiled_bytes(jitted: Any, *args: Any) -> int | None:
    """Arguments + outputs + scratch of one compiled call (None where the backend cannot say)."""
    stats = jitted.lower(*args).compile().memory_analysis()
    if stats is None:
        return None
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes)


def armt_working_bytes(armt: Any, num_segments: int) -> int | None:
    """Largest compiled piece of the diagonal schedule for `num_segments` segments (state, pipeline,
    weights and one chunk of logits included); independent of the input length by construction."""
    blocks, _ = plan(None, num_segments, True, armt.config.num_layers)
    pipe = empty_pipeline(armt, zero_state(armt, 1))
    sizes = []
    for block in set(blocks):
        k = block[1] if block[0] == "full" else sum(s[2] for s in block[1])
        s = armt.armt.segment_size
        segs = Segments(
            jnp.zeros((k, 1, s), jnp.int32), jnp.zeros((k, 1), jnp.int32), jnp.zeros((k, 1), bool)
        )
        sizes.append(
            compiled_bytes(
                run_block, armt, block, armt.cpu_execution, armt.projections, armt.params, pipe, segs
            )
        )
    return None if None in sizes else max(sizes)


def diagonal_executor(armt: Any, num_segments: int) -> str:
    """How `schedule="diagonal"` runs this input on this backend (see `CPUExecution`)."""
    if not diagonal_pays_off(armt, 1, num_segments):
        return "sequential order (CPU: too few segments or too many rows to batch)"
    L = armt.config.num_layers
    batched = batch_cells(armt.cpu_execution, L, L, 1, armt.armt.rows)
    return "pipeline, full diagonals batched" if batched else "pipeline, cell by cell"


def diagonal_runs(
    armt: Any, name: str, projections: tuple[str, ...], kernel: str
) -> dict[str, Callable[[Any], Any]]:
    """Timing key -> forward of the diagonal schedule: the model's default projections when
    `projections` is empty, else one entry per projection method ("diagonal/<method> <name>")."""
    if not projections:
        return {f"diagonal {name}": lambda ids: armt(ids, schedule="diagonal")}
    from jaxlongctx.armt import DiagonalProjections

    def forward(method: str) -> Callable[[Any], Any]:
        def call(ids: Any) -> Any:
            armt.projections = DiagonalProjections(method, kernel)
            return armt(ids, schedule="diagonal")

        return call

    return {f"diagonal/{m} {name}": forward(m) for m in projections}


def run(sweep_name: str, save: Callable[[dict[str, Any]], Any] = lambda payload: None) -> dict[str, Any]:
    """Run one sweep, handing the payload so far to `save` after every length; returns the payload."""
    sweep = SWEEPS[sweep_name]
    full, projections = sweep.get("full", True), sweep.get("projections", ())
    dtype = jnp.dtype(sweep["dtype"])
    model = Model.init(ModelConfig(**sweep["model"]), seed=0, dtype=dtype)
    armts = {}
    for i, (seg, mem) in enumerate(sweep["armt"]):
        a = ARMTModel.wrap(model, ARMTConfig(seg, mem, **sweep.get("cell", {})), jax.random.key(i))
        armts[f"{seg}/{mem}"] = a.randomize_memory_params(jax.random.key(100 + i), 0.1)
        if sweep.get("pipeline_on_cpu"):  # run the pipeline as an accelerator does, not CPU's shortcuts
            a.cpu_execution = PIPELINE_ALWAYS
    rng = np.random.default_rng(0)
    L = model.config.num_layers
    rows = []
    for length in sweep["lengths"]:
        ids = rng.integers(0, model.config.vocab_size, (1, length)).astype(np.int32)
        fns = {"full": lambda: model(ids)} if full else {}
        for name, a in armts.items():
            fns[f"sequential {name}"] = lambda a=a: a(ids, schedule="sequential")
            diagonal = diagonal_runs(a, name, projections, sweep.get("kernel", "auto"))
            fns.update({k: lambda f=f: f(ids) for k, f in diagonal.items()})
        times = interleaved_times(fns, repeats=sweep["repeats"])
        row = {
            "length": length,
            "times": times,
            "full_attention_kv_bytes": armts[next(iter(armts))].full_attention_kv_bytes(length),
        }
        if full and sweep.get("full_memory", True):
            row["full_forward_bytes"] = compiled_bytes(
                model._forward, model.params, jnp.asarray(ids), jnp.ones(ids.shape, bool)
            )
        for name, a in armts.items():
            n_seg = -(-length // a.armt.segment_size)
            blocks, _ = plan(None, n_seg, True, L)
            diag_key = f"diagonal/{projections[0]} {name}" if projections else f"diagonal {name}"
            seq, diag = times[f"sequential {name}"]["median_s"], times[diag_key]["median_s"]
            best = times[diag_key]["min_s"] / times[f"sequential {name}"]["min_s"]
            row[name] = {
                "segments": n_seg,
                "diagonal_vs_sequential": diag / seq,
                "diagonal_vs_sequential_best_of_n": best,
                "state_bytes": a.state_bytes(),
                "computed_cells": computed_cells(blocks, L),
                "useful_cells": n_seg * L,
                "diagonal_executor": diagonal_executor(a, n_seg),
                "ramp_waste": 1 - n_seg * L / computed_cells(blocks, L),
                "fixed_buffer_ramp_waste": fixed_buffer_waste(n_seg, L),
            }
            for method in projections[1:]:  # each further projection method against the first and sequential
                t = times[f"diagonal/{method} {name}"]["median_s"]
                row[name][method] = {"diagonal_vs_sequential": t / seq, f"vs_{projections[0]}": t / diag}
            line = f"{length:>7} {name:>9}: seq {seq:.3f}s  diag {diag:.3f}s  diag/seq {diag / seq:.2f}"
            if full:
                row[name].update(
                    {
                        "full_vs_diagonal": times["full"]["median_s"] / diag,
                        "full_vs_best_armt": times["full"]["median_s"] / min(seq, diag),
                    }
                )
                if sweep.get("full_memory", True):
                    row[name]["diagonal_working_bytes"] = armt_working_bytes(a, n_seg)
                line += f"  full {times['full']['median_s']:.3f}s  full/diag {times['full']['median_s'] / diag:.2f}"
            print(
                line
                + "".join(f"  {m}/seq {row[name][m]['diagonal_vs_sequential']:.2f}" for m in projections[1:]),
                flush=True,
            )
        rows.append(row)
        save({"sweep": sweep_name, "config": sweep, "rows": rows, "complete": False})
    summary = {}
    for name in armts:
        ratios = [r[name]["diagonal_vs_sequential"] for r in rows]
        faster = [r["length"] for r in rows if r[name].get("full_vs_best_armt", 0) > 1]
        first = {k: v["first_call_s"] - v["median_s"] for k, v in rows[0]["times"].items() if name in k}
        later = (
            {
                k: max(r["times"][k]["first_call_s"] - r["times"][k]["median_s"] for r in rows[1:])
                for k in first
            }
            if rows[1:]
            else {}
        )
        summary[name] = {
            "worst_diagonal_vs_sequential": max(ratios),
            "best_diagonal_vs_sequential": min(ratios),
            "worst_diagonal_vs_sequential_best_of_n": max(
                r[name]["diagonal_vs_sequential_best_of_n"] for r in rows
            ),
            "armt_faster_than_full_from": faster[0] if full and faster else None,
            "compile_s_first_length": first,
            "compile_s_later_lengths_max": later,
        }
    # where the diagonal ran in sequential order both sides run the same code: their spread is noise
    same = [
        r[n]["diagonal_vs_sequential"]
        for r in rows
        for n in armts
        if r[n]["diagonal_executor"].startswith("seq")
    ]
    summary["timing_noise"] = {
        "same_code_points": len(same),
        "max_abs_ratio_deviation": max((abs(x - 1) for x in same), default=None),
    }
    return {
        "sweep": sweep_name,
        "config": {**sweep, "model": sweep["model"]},
        "rows": rows,
        "summary": summary,
        "peak_rss_bytes": peak_rss_bytes(),
        "complete": True,
    }


def plot(payload: dict[str, Any], name: str) -> None:
    """Log-log wall time against length: full attention, and each ARMT config's two schedules."""
    rows = payload["rows"]
    lengths = [r["length"] for r in rows]
    fig, ax = subplots(figsize=(7, 5))
    configs = sorted(
        {k.split()[-1] for k in rows[0]["times"] if k != "full"}, key=lambda c: int(c.split("/")[0])
    )
    for key in rows[0]["times"]:
        kind, config = (key.split() + [""])[:2]
        color = "k" if key == "full" else f"C{configs.index(config)}"
        ax.plot(
            lengths,
            [r["times"][key]["median_s"] for r in rows],
            "--" if kind == "sequential" else "-",
            color=color,
            marker="o",
            ms=3,
            label=key,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("input tokens")
    ax.set_ylabel("forward wall time (s, median)")
    ax.set_title(f"ARMT schedules vs full attention ({payload['sweep']}, {jax.default_backend()})")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    save_plot(fig, plot_path(name), dpi=120)


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU: lengths 1K..8K and three ARMT configs")
    parser.add_argument(
        "--sweep",
        choices=("device", "device_dry_run", "published_device", "published_device_dry_run"),
        help="the device run's sweep (writes armt_schedule_<sweep>.json); default: by backend",
    )
    parser.add_argument(
        "--published", action="store_true", help="CPU: the published cell at a small shape (1K..8K)"
    )
    args = parser.parse_args()
    if args.published:
        payload = run("published_cpu")
        write_result("armt_published_schedule", payload)
        plot(payload, "armt_published_schedule")
        return
    if args.sweep:
        name = f"armt_schedule_{args.sweep}"
        payload = run(args.sweep, lambda partial: write_result(name, partial))
        write_result(name, payload)
        plot(payload, name)
        return
    use_quick_results(args.quick)
    gpu = jax.default_backend() == "gpu"
    sweep = "gpu" if gpu else ("cpu_quick" if args.quick else "cpu")
    payload = run(sweep)
    if not gpu:
        payload["gpu_sweep"] = {
            "config": SWEEPS["gpu"],
            "status": "not run: no GPU on this machine; "
            "the script runs this sweep unchanged when one is present",
        }
    write_result("armt_schedule", payload)
    plot(payload, "armt_schedule")


if __name__ == "__main__":
    main()
