"""Haystack retrieval accuracy vs context length: ARMT (diagonal schedule) vs full attention.

    python -m bench.armt_retrieval [--quick] [--armt-ckpt DIR] [--base DIR] [--num-facts 1,2,4]

Held-out samples (evaluation seeds); exact match and per-digit accuracy of the 4-digit answer
(teacher-forced argmax, equivalent to greedy decoding being right), with the chance levels; ARMT
logits are those its decoding computes, with the prompt's last segment still in view. ARMT
runs once per fact count (row `armt_{n}_facts`): with one fact the memory only has to keep a code,
with several it must keep which code belongs to which subject and answer the asked one. Full
attention runs on the largest count, twice: the pretrained base model, and the ARMT model's own
fine-tuned weights without the memory. ARMT rows also split the samples by whether the answer
needed the memory, by how deep in the prompt the asked fact lies (a third panel plots exact
match against that depth for the largest count) and by whether another fact's subject shares a
word with the asked one; they count wrong answers per digit and first digits that start another
fact's code (the digit that picks the fact; teacher forcing hides the rest). ARMT cuts the prompts as
the checkpoint was saved (`segmentation` in the JSON), and the splits use those segments. (bench/armt_fact_errors.py
looks closer at those errors.) A last ARMT row
(`armt_{n}_facts_near_miss`, the largest count if above 1) asks only near misses: every other fact's
subject shares the asked subject's colour or object. Every exact match comes with its 95% Wilson
interval (`exact_match_ci95`, the error bars of the plot). `goal` scores each ARMT row at 4x the
longest training sample of the checkpoint's `training.json` against the 90% target. The filler is
the validation split's text; when the checkpoint's lineage trained on that text too (`training.json`),
a row `armt_{n}_facts_unseen_filler` (the smallest count) repeats the sweep on the first split the
memory never met as filler in fine-tuning (train, text the base model pretrained on; else calibration,
text no training saw), so the plot shows how much of the accuracy is owed to knowing the filler.
Writes bench/results/armt_retrieval.{json,png}.

`--goal-only --goal-samples N` scores just the goal: each ARMT fact count at 4x the longest training
sample on the first N held-out samples (the sweep's 64 among them), to narrow the 95% interval the
sweep leaves around 90%; writes bench/results/armt_retrieval_goal.json. The prompts are cut as the
checkpoint was saved (every S tokens, or after sentence ends: see `jaxlongctx.armt.sentences`);
`--segmentation fixed|sentences` overrides that and writes bench/results/armt_retrieval_goal_{name}.json.

`--split-lengths 2048,16384 --split-samples N` looks at the one-fact errors' main cause: a segment
boundary between the asked subject and its code's last digit, which leaves the subject-code binding
to the memory. At each length, one fact on the first N held-out samples as drawn (row `one_fact`,
about 5% of them split) and on the same samples shifted so that a boundary splits every asked fact
(row `split_fact`), each cut on the fixed grid and after sentence ends (rows `*_sentences`, where no
segment starts inside a sentence: the shift no longer splits the fact); writes
bench/results/armt_split_facts.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bench.common import plot_path, repo_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.armt.sentences import SEGMENTATIONS
from jaxlongctx.data.corpus import SPLITS
from jaxlongctx.data.haystack import CODE_DIGITS, FILLER_SPLIT
from jaxlongctx.demo import ARMT_MODEL, BASE_MODEL
from jaxlongctx.loading import load
from jaxlongctx.train.evaluate import DIGIT_CHANCE, retrieval_accuracy

GOAL_FACTOR, GOAL_EXACT_MATCH = 4, 0.9  # the target: 90% exact match at 4x the longest training sample
UNSEEN_FILLER_ORDER = tuple(s for s in SPLITS if s != FILLER_SPLIT)  # train, then calibration


def main() -> None:
    """Evaluate both models over the length sweep and write JSON + PNG."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="lengths 512..4K, 8 samples each")
    p.add_argument("--armt-ckpt", default=str(ARMT_MODEL))
    p.add_argument("--base", default=str(BASE_MODEL))
    p.add_argument(
        "--num-facts", default="1,2,4", help="comma-separated fact counts for ARMT (default 1,2,4)"
    )
    p.add_argument("--goal-only", action="store_true", help="score only the goal length (see above)")
    p.add_argument("--goal-samples", type=int, default=128, help="samples per fact count with --goal-only")
    p.add_argument(
        "--split-lengths",
        default=None,
        help="comma-separated lengths: score only one fact split by a boundary (see above)",
    )
    p.add_argument("--split-samples", type=int, default=128, help="samples per length with --split-lengths")
    p.add_argument(
        "--segmentation",
        choices=SEGMENTATIONS,
        default=None,
        help="with --goal-only: how ARMT cuts the prompts into segments (default: as the checkpoint "
        "was saved)",
    )
    args = p.parse_args()
    use_quick_results(args.quick)
    counts = sorted({int(n) for n in args.num_facts.split(",")})
    most = counts[-1]
    if args.goal_only:
        goal_only(Path(args.armt_ckpt), counts, args.goal_samples, args.segmentation)
        return
    if args.split_lengths:
        split_facts(Path(args.armt_ckpt), [int(n) for n in args.split_lengths.split(",")], args.split_samples)
        return
    armt, base = load(args.armt_ckpt, "fp32"), load(args.base, "fp32")
    if args.quick:
        full = [(n, 8) for n in (512, 2048)]
        armt_plan = [(n, 8) for n in (512, 1024, 2048, 4096)]
        near_miss_plan = [(n, 8) for n in (512, 2048)]
    else:
        full = [(512, 64), (1024, 32), (2048, 16), (4096, 8), (8192, 4)]
        # 64 samples at 32K and 64K (4x the longest training length) keep the 95% interval within about
        # +-8 points near 90% exact match
        armt_plan = [
            (512, 64),
            (1024, 64),
            (2048, 64),
            (4096, 64),
            (8192, 128),
            (16384, 32),
            (32768, 64),
            (65536, 64),
        ]
        near_miss_plan = [(1024, 64), (4096, 64), (16384, 32), (65536, 16)]

    armt_diagonal = diagonal_decoding_logits(armt)

    def full_attention(model):
        return lambda ids, prompt_length: model(ids)

    # row -> (model, its segment size or None, facts, near misses only, filler split, [(length, samples)])
    segment, val = armt.armt.segment_size, FILLER_SPLIT
    runs = {f"armt_{n}_facts": (armt_diagonal, segment, n, False, val, armt_plan) for n in counts}
    if most > 1:  # with one fact there is nothing to miss
        runs[f"armt_{most}_facts_near_miss"] = (armt_diagonal, segment, most, True, val, near_miss_plan)
    unseen = unseen_filler_split(Path(args.armt_ckpt))
    if unseen is not None:
        runs[f"armt_{counts[0]}_facts_unseen_filler"] = (
            armt_diagonal,
            segment,
            counts[0],
            False,
            unseen,
            armt_plan,
        )
    runs.update(
        {
            "full_attention": (full_attention(base), None, most, False, val, full),
            "full_attention_finetuned": (full_attention(armt.base), None, most, False, val, full),
        }
    )
    rows: dict[str, list[dict]] = {name: [] for name in runs}
    for name, (model, segment_size, facts, near_miss, filler, sizes) in runs.items():
        for length, samples in sizes:
            t0 = time.perf_counter()
            r = retrieval_accuracy(
                model,
                length,
                samples,
                num_facts=facts,
                segment_size=segment_size,
                segment_starts=armt.segment_starts if segment_size else None,
                shared_word=near_miss,
                filler_split=filler,
            )
            r["wall_s"] = time.perf_counter() - t0
            rows[name].append(r)
            print(name, r, flush=True)
    chance = {"exact_match": DIGIT_CHANCE**CODE_DIGITS, "digit_accuracy": DIGIT_CHANCE}
    goal = goal_check(rows, longest_training_tokens(Path(args.armt_ckpt)))
    write_result(
        "armt_retrieval",
        {
            "armt_ckpt": repo_path(args.armt_ckpt),
            "base": repo_path(args.base),
            "segmentation": armt.segmentation,
            "num_facts": {name: run[2] for name, run in runs.items()},
            "filler_split": {name: run[4] for name, run in runs.items()},
            "quick": args.quick,
            "chance": chance,
            "results": rows,
            "goal": goal,
            "plot": "armt_retrieval.png",
        },
    )
    _plot(rows, chance, f"armt_{most}_facts", goal, armt.segmentation)


def diagonal_decoding_logits(armt):
    """`model(ids, prompt_length)` for `retrieval_accuracy`: the logits ARMT decoding computes on the
    diagonal schedule (the prompt's last segment kept open)."""
    return lambda ids, prompt_length: armt.generation_logits(ids, prompt_length, schedule="diagonal")


def goal_only(ckpt: Path, counts: list[int], samples: int, segmentation: str | None = None) -> None:
    """Score each fact count at the goal length on `samples` held-out samples, the prompts cut by
    `segmentation` (None: as the checkpoint was saved); write the goal JSON (its name says an override)."""
    longest = longest_training_tokens(ckpt)
    if longest is None:
        raise SystemExit(f"error: {ckpt / 'training.json'} is missing, so the goal length is unknown")
    armt = load(ckpt, "fp32")
    saved = armt.segmentation
    armt.segmentation = segmentation = segmentation or saved
    rows = {}
    for facts in counts:
        t0 = time.perf_counter()
        r = retrieval_accuracy(
            diagonal_decoding_logits(armt),
            GOAL_FACTOR * longest,
            samples,
            num_facts=facts,
            segment_size=armt.armt.segment_size,
            segment_starts=armt.segment_starts,
            progress=True,
        )
        rows[f"armt_{facts}_facts"] = [{**r, "wall_s": time.perf_counter() - t0}]
        print(f"armt_{facts}_facts", r, flush=True)
    name = "armt_retrieval_goal" + ("" if segmentation == saved else f"_{segmentation}")
    write_result(
        name,
        {
            "armt_ckpt": repo_path(ckpt),
            "filler_split": FILLER_SPLIT,
            "segmentation": segmentation,
            "results": rows,
            "goal": goal_check(rows, longest),
        },
    )


# row, asked fact split on the grid, segmentation, label, plot style (hollow squares: the sentence rows can coincide)
SPLIT_ROWS = (
    ("one_fact", False, "fixed", "as drawn", {}),
    ("split_fact", True, "fixed", "boundary inside the asked fact", {}),
    (
        "one_fact_sentences",
        False,
        "sentences",
        "as drawn, sentence segments",
        {"fmt": "s--", "markersize": 11, "markerfacecolor": "none"},
    ),
    ("split_fact_sentences", True, "sentences", "shifted as above, sentence segments", {"fmt": "^:"}),
)
SEGMENTATION_LABELS = {"fixed": "fixed grid", "sentences": "sentence segments"}


def split_facts(ckpt: Path, lengths: list[int], samples: int) -> None:
    """One fact at each length, on held-out samples as drawn and with a fixed-grid boundary splitting
    every asked fact, each cut on the fixed grid and after sentence ends; write the JSON and the plot."""
    armt = load(ckpt, "fp32")
    rows: dict[str, list[dict]] = {name: [] for name, *_ in SPLIT_ROWS}
    for length in lengths:
        for name, split, segmentation, *_ in SPLIT_ROWS:
            armt.segmentation = segmentation
            t0 = time.perf_counter()
            r = retrieval_accuracy(
                diagonal_decoding_logits(armt),
                length,
                samples,
                num_facts=1,
                segment_size=armt.armt.segment_size,
                segment_starts=armt.segment_starts,
                split_facts=split,
                progress=True,
            )
            rows[name].append({**r, "segmentation": segmentation, "wall_s": time.perf_counter() - t0})
            print(
                name,
                length,
                {
                    k: r[k]
                    for k in (
                        "exact_match",
                        "code_split_samples",
                        "code_split_exact_match",
                        "wrong_digit_rate",
                    )
                },
                flush=True,
            )
    write_result(
        "armt_split_facts",
        {
            "armt_ckpt": repo_path(ckpt),
            "filler_split": FILLER_SPLIT,
            "segment_size": armt.armt.segment_size,
            "results": rows,
            "plot": "armt_split_facts.png",
        },
    )
    fig, axes = subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for name, _, _, label, style in SPLIT_ROWS:
        _exact_match_errorbar(ax, rows[name], f"{label} ({samples} samples)", **style)
    _length_axis(ax, "exact match (bars: 95% interval)")
    ax.legend(fontsize=8)
    ax = axes[1]  # which digit goes wrong on the shifted samples
    for name, style in (("split_fact", "o-"), ("split_fact_sentences", "s--")):
        for r in rows[name]:
            ax.plot(
                range(1, CODE_DIGITS + 1),
                r["wrong_digit_rate"],
                style,
                label=f"{r['length']:,} tokens, {SEGMENTATION_LABELS[r['segmentation']]}",
            )
    ax.set_xticks(range(1, CODE_DIGITS + 1))
    ax.set_xlabel("answer digit (teacher-forced)")
    ax.set_ylabel("share of shifted samples wrong at the digit")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(
        "ARMT, one fact: a segment boundary between subject and code, and segments cut after sentences"
    )
    save_plot(fig, plot_path("armt_split_facts"), dpi=110)


def longest_training_tokens(ckpt: Path) -> int | None:
    """Longest training sample (tokens) over the shipped lineage in `ckpt/training.json` (its `runs`;
    runs kept under `not_shipped` are not part of the model); None without a record."""
    record = ckpt / "training.json"
    if not record.is_file():
        return None
    runs = json.loads(record.read_text())["runs"]
    return max(stage["tokens"] for run in runs for stage in run.get("curriculum", []))


def unseen_filler_split(ckpt: Path) -> str | None:
    """The first split of UNSEEN_FILLER_ORDER that the lineage in `ckpt/training.json` never drew
    filler from, when it fine-tuned on the evaluation filler (the validation split; runs recorded
    without `filler_split` predate the option and used it); None otherwise (no record, every split
    seen, or the validation text is already new to it)."""
    record = ckpt / "training.json"
    if not record.is_file():
        return None
    used = {run.get("filler_split", FILLER_SPLIT) for run in json.loads(record.read_text())["runs"]}
    if FILLER_SPLIT not in used:
        return None
    return next((split for split in UNSEEN_FILLER_ORDER if split not in used), None)


def goal_check(rows: dict[str, list[dict]], longest: int | None) -> dict | None:
    """The goal: ARMT exact match >= GOAL_EXACT_MATCH at GOAL_FACTOR x the longest training sample.
    Per ARMT row at that length: the point estimate, its 95% interval, `met` (point estimate at or
    above the goal), `met_with_confidence` (the whole interval at or above it) and
    `missed_with_confidence` (the whole interval below it). None when the record or
    that length is missing (e.g. --quick)."""
    if longest is None:
        return None
    length = GOAL_FACTOR * longest
    out = {
        "longest_training_tokens": longest,
        "length": length,
        "exact_match_goal": GOAL_EXACT_MATCH,
        "rows": {},
    }
    for name, rs in rows.items():
        cell = next((r for r in rs if r["length"] == length), None)
        if name.startswith("armt") and cell is not None:
            low, high = cell["exact_match_ci95"]
            out["rows"][name] = {
                "samples": cell["samples"],
                "exact_match": cell["exact_match"],
                "exact_match_ci95": [low, high],
                "met": cell["exact_match"] >= GOAL_EXACT_MATCH,
                "met_with_confidence": low >= GOAL_EXACT_MATCH,
                "missed_with_confidence": high < GOAL_EXACT_MATCH,
            }
    return out if out["rows"] else None


def _exact_match_errorbar(ax, rows: list[dict], label: str, **style) -> None:
    """Exact match vs length of `rows`, with each point's 95% Wilson interval as error bars (`style`:
    matplotlib errorbar options, default fmt "o-")."""
    y = np.array([r["exact_match"] for r in rows])
    ci = np.array([r["exact_match_ci95"] for r in rows]).T
    ax.errorbar(
        [r["length"] for r in rows], y, yerr=np.abs(ci - y), capsize=3, label=label, **{"fmt": "o-", **style}
    )


def _length_axis(ax, ylabel: str) -> None:
    """A log2 context-length x axis against a rate in [0, 1]."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)


def _plot(
    rows: dict[str, list[dict]],
    chance: dict[str, float],
    depth_row: str,
    goal: dict | None,
    segmentation: str,
) -> None:
    fig, axes = subplots(1, 3, figsize=(16, 4))
    for ax, metric in zip(axes, ("exact_match", "digit_accuracy")):
        for name, rs in rows.items():
            if metric == "exact_match":
                _exact_match_errorbar(ax, rs, name)
            else:
                ax.plot([r["length"] for r in rs], [r[metric] for r in rs], "o-", label=name)
        ax.axhline(chance[metric], color="gray", ls="--", label=f"chance ({chance[metric]:g})")
        if goal is not None and metric == "exact_match":
            ax.plot(
                [goal["length"]],
                [goal["exact_match_goal"]],
                "k*",
                ms=12,
                label=f"goal: {goal['exact_match_goal']:.0%} at {goal['length']:,} tokens",
            )
        _length_axis(ax, metric + (" (bars: 95% interval)" if metric == "exact_match" else ""))
    axes[0].legend(fontsize=8)
    ax = axes[2]  # where ARMT loses the fact: exact match by the asked fact's depth in the prompt
    for r in rows[depth_row]:
        mids = [sum(d["depth"]) / 2 for d in r["by_depth"]]
        ax.plot(
            mids,
            [np.nan if d["exact_match"] is None else d["exact_match"] for d in r["by_depth"]],
            "o-",
            label=f"{r['length']:,} tokens",
        )
    ax.set_xlabel("depth of the fact in the prompt (0 = start, 1 = next to the question)")
    ax.set_ylabel(f"{depth_row} exact_match")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(
        f"haystack retrieval: ARMT (diagonal schedule, {SEGMENTATION_LABELS[segmentation]}) vs full attention"
    )
    save_plot(fig, plot_path("armt_retrieval"), dpi=110)


if __name__ == "__main__":
    main()
