"""Where in a long prompt ARMT loses a fact: exact match against context length and the asked
fact's depth, a needle-in-a-haystack heatmap per fact count.

    python -m bench.armt_depth [--quick] [--armt-ckpt DIR] [--num-facts 1,2,4]
                               [--lengths 4096,16384,32768,65536] [--depths 0.05,0.25,0.5,0.75,0.95]
                               [--samples 16]

Every cell scores the same held-out samples (`held_out_batch(target_depth=...)`: sample i keeps its
filler, subjects and codes at every depth, only the facts move), with the asked fact placed at a
relative depth of the filler (0 = right after <bos>, far from the question; 1 = next to it) and the
other facts at uniform depths. Teacher-forced exact match of the decoding logits on the diagonal
schedule, prompts cut as the checkpoint was saved. The retrieval bench's `by_depth` splits its
random-depth samples after the fact; here the depth is set, so a trend is not a sampling accident.
Writes bench/results/armt_depth.{json,png}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench.armt_retrieval import GOAL_EXACT_MATCH, SEGMENTATION_LABELS, diagonal_decoding_logits
from bench.common import plot_path, repo_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.demo import ARMT_MODEL
from jaxlongctx.loading import load
from jaxlongctx.train.evaluate import retrieval_accuracy

CELL_KEYS = (
    "length",
    "target_depth",
    "asked_depth",
    "samples",
    "exact_match",
    "exact_match_ci95",
    "digit_accuracy",
    "first_digit_other_fact_rate",
    "from_memory_samples",
)


def depth_grid(
    ckpt: Path, counts: list[int], lengths: list[int], depths: list[float], samples: int, quick: bool = False
) -> dict:
    """Score every (fact count, length, depth) cell on `samples` held-out samples; write the JSON and
    the heatmaps, and return the JSON's payload."""
    if not lengths or not depths or not counts or samples < 1:
        raise ValueError("depth_grid needs lengths, depths, fact counts and samples >= 1")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must lie in [0, 1], got {depths}")
    armt = load(ckpt, "fp32")
    logits = diagonal_decoding_logits(armt)
    rows: dict[str, list[list[dict]]] = {}
    for facts in counts:
        name = f"armt_{facts}_facts"
        rows[name] = []
        for length in lengths:
            line = []
            for depth in depths:
                t0 = time.perf_counter()
                r = retrieval_accuracy(
                    logits,
                    length,
                    samples,
                    num_facts=facts,
                    segment_size=armt.armt.segment_size,
                    segment_starts=armt.segment_starts,
                    target_depth=depth,
                    progress=True,
                )
                line.append({**{k: r[k] for k in CELL_KEYS}, "wall_s": time.perf_counter() - t0})
                print(name, length, depth, f"exact match {r['exact_match']:.3f}", flush=True)
            rows[name].append(line)
    payload = {
        "armt_ckpt": repo_path(ckpt),
        "segmentation": armt.segmentation,
        "quick": quick,
        "lengths": lengths,
        "depths": depths,
        "samples_per_cell": samples,
        "results": rows,
        "plot": "armt_depth.png",
    }
    write_result("armt_depth", payload)
    _plot(rows, lengths, depths, samples, armt.segmentation)
    return payload


def _facts_label(name: str) -> str:
    """'armt_1_facts' -> '1 fact', 'armt_4_facts' -> '4 facts'."""
    count = int(name.split("_")[1])
    return f"{count} fact{'s' if count != 1 else ''}"


def _plot(
    rows: dict[str, list[list[dict]]],
    lengths: list[int],
    depths: list[float],
    samples: int,
    segmentation: str,
) -> None:
    """One heatmap per fact count (length down, depth across, exact match in %), and exact match
    against depth at the longest length for every count, with 95% intervals."""
    fig, axes = subplots(1, len(rows) + 1, figsize=(4.2 * (len(rows) + 1), 3.8), squeeze=False)
    for ax, (name, grid) in zip(axes[0], rows.items()):
        em = np.array([[c["exact_match"] for c in line] for line in grid])  # L D
        ax.imshow(em, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")  # red 0%, yellow 50%, green 100%
        for (i, j), value in np.ndenumerate(em):
            ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(lengths)), [f"{n:,}" for n in lengths])
        ax.set_xlabel("asked fact's depth (0 = start, 1 = question)")
        ax.set_ylabel("context length (tokens)")
        ax.set_title(f"{_facts_label(name)}: exact match, {samples} samples per cell", fontsize=9)
    ax = axes[0, -1]
    for name, grid in rows.items():
        y = np.array([c["exact_match"] for c in grid[-1]])
        ci = np.array([c["exact_match_ci95"] for c in grid[-1]]).T
        ax.errorbar(depths, y, yerr=np.abs(ci - y), fmt="o-", capsize=3, label=_facts_label(name))
    ax.axhline(
        GOAL_EXACT_MATCH, color="grey", linestyle="--", linewidth=1, label=f"goal ({GOAL_EXACT_MATCH:.0%})"
    )
    ax.set_xlabel("asked fact's depth")
    ax.set_ylabel(f"exact match at {lengths[-1]:,} tokens (bars: 95%)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(
        f"ARMT (diagonal schedule, {SEGMENTATION_LABELS[segmentation]}): exact match by length and depth"
    )
    save_plot(fig, plot_path("armt_depth"), dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="512 and 2K tokens, depths 0.1 and 0.9, 4 samples, 1-2 facts"
    )
    p.add_argument("--armt-ckpt", default=str(ARMT_MODEL))
    p.add_argument("--num-facts", default="1,2,4")
    p.add_argument("--lengths", default="4096,16384,32768,65536")
    p.add_argument("--depths", default="0.05,0.25,0.5,0.75,0.95")
    p.add_argument("--samples", type=int, default=16, help="held-out samples per cell")
    args = p.parse_args()
    use_quick_results(args.quick)
    if args.quick:
        counts, lengths, depths, samples = [1, 2], [512, 2048], [0.1, 0.9], 4
    else:
        counts = sorted({int(n) for n in args.num_facts.split(",")})
        lengths = sorted({int(n) for n in args.lengths.split(",")})
        depths = sorted({float(d) for d in args.depths.split(",")})
        samples = args.samples
    depth_grid(Path(args.armt_ckpt), counts, lengths, depths, samples, quick=args.quick)


if __name__ == "__main__":
    main()
