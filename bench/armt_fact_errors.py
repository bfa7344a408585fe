"""What goes wrong when ARMT answers a haystack of several facts: the attention ceiling of one
segment, which digit is wrong, and what greedy decoding then writes.

    python -m bench.armt_fact_errors [--quick] [--armt-ckpt DIR]

For 2 and 4 facts, on held-out haystacks of one segment (every fact in the decoding window: the
accuracy attention alone reaches, no memory involved), of 512 tokens (4 segments) and of 4K: the
teacher-forced scores of `retrieval_accuracy` (exact match, wrong-answer rate per digit, first digits
that start another fact's code) and the greedy answers of `jaxlongctx.generate` on the same samples (their
exact match must equal the teacher-forced one; a wrong answer is another fact's whole code, or
something else). Writes bench/results/armt_fact_errors.{json,png}.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.armt_retrieval import diagonal_decoding_logits
from bench.common import plot_path, repo_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.data.haystack import CODE_DIGITS, held_out_batch
from jaxlongctx.data.tokenizer import load_default_tokenizer
from jaxlongctx.demo import ARMT_MODEL
from jaxlongctx.generate import generate
from jaxlongctx.loading import load
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.train.evaluate import retrieval_accuracy

GREEDY_BATCH = 8


def greedy_answers(armt, length: int, samples: int, num_facts: int) -> dict[str, float]:
    """Greedy decoding of the answers of `retrieval_accuracy`'s samples (the same held-out prompts):
    exact match and the share of samples answered with another fact's whole code."""
    tokenizer = load_default_tokenizer()
    right = other = 0
    for start in range(0, samples, GREEDY_BATCH):
        raw = held_out_batch(
            range(start, min(start + GREEDY_BATCH, samples)), length, tokenizer, num_facts=num_facts
        )
        answer, codes = raw["answer_ids"], raw["fact_answer_ids"]  # B D, B F D
        got = np.asarray(generate(armt, raw["ids"], SamplingParams(CODE_DIGITS)))[:, -CODE_DIGITS:]  # B D
        ok = (got == answer).all(axis=1)
        right += int(ok.sum())
        other += int(((got[:, None] == codes).all(axis=-1).any(axis=1) & ~ok).sum())
    return {"greedy_exact_match": right / samples, "greedy_other_fact_code_rate": other / samples}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 samples per cell, one segment and 512 tokens")
    p.add_argument("--armt-ckpt", default=str(ARMT_MODEL))
    args = p.parse_args()
    use_quick_results(args.quick)
    armt = load(args.armt_ckpt, "fp32")
    segment = armt.armt.segment_size
    plan = [(segment, 8), (512, 8)] if args.quick else [(segment, 128), (512, 64), (4096, 32)]

    decoding_logits = diagonal_decoding_logits(armt)

    cells = []
    for facts in (2, 4):
        for length, samples in plan:
            t0 = time.perf_counter()
            r = retrieval_accuracy(
                decoding_logits,
                length,
                samples,
                num_facts=facts,
                segment_size=segment,
                segment_starts=armt.segment_starts,
            )
            cell = {
                key: r[key]
                for key in (
                    "num_facts",
                    "length",
                    "samples",
                    "exact_match",
                    "exact_match_ci95",
                    "digit_accuracy",
                    "wrong_digit_rate",
                    "first_digit_other_fact_rate",
                    "in_segment_samples",
                    "in_segment_exact_match",
                )
            }
            cell.update(greedy_answers(armt, length, samples, facts), wall_s=time.perf_counter() - t0)
            cells.append(cell)
            print(cell, flush=True)
    write_result(
        "armt_fact_errors",
        {
            "armt_ckpt": repo_path(args.armt_ckpt),
            "segment_size": segment,
            "segmentation": armt.segmentation,
            "quick": args.quick,
            "cells": cells,
            "plot": "armt_fact_errors.png",
        },
    )
    _plot(cells, segment)


def _plot(cells: list[dict], segment: int) -> None:
    fig, axes = subplots(1, 2, figsize=(12, 4))
    labels = [
        f"{c['num_facts']} facts\n{c['length']:,} tok" + (" (1 seg)" if c["length"] == segment else "")
        for c in cells
    ]
    x = np.arange(len(cells))
    right = np.array([c["greedy_exact_match"] for c in cells])
    other = np.array([c["greedy_other_fact_code_rate"] for c in cells])
    ax = axes[0]  # greedy answers: right / another fact's code / anything else
    ax.bar(x, right, label="right code", color="tab:green")
    ax.bar(x, other, bottom=right, label="another fact's whole code", color="tab:red")
    ax.bar(x, 1 - right - other, bottom=right + other, label="other wrong answer", color="tab:gray")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("share of greedy answers")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="lower left")
    ax = axes[1]  # teacher forcing: which digit is wrong
    width = 0.8 / CODE_DIGITS
    for d in range(CODE_DIGITS):
        ax.bar(
            x + (d - (CODE_DIGITS - 1) / 2) * width,
            [c["wrong_digit_rate"][d] for c in cells],
            width,
            label=f"digit {d + 1}",
        )
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("samples wrong at this digit (teacher forced)")
    ax.legend(fontsize=8)
    for a in axes:
        a.grid(alpha=0.3, axis="y")
    fig.suptitle("ARMT with several facts: what greedy decoding answers, and which digit is wrong")
    save_plot(fig, plot_path("armt_fact_errors"), dpi=110)


if __name__ == "__main__":
    main()
