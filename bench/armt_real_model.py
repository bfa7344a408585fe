"""Chat-haystack retrieval on SmolLM2-135M-Instruct: full attention (native 8K context) vs an ARMT memory.

    python -m bench.armt_real_model --model DIR [--lengths 4096,...] [--samples N] [--quick]

`--model` is an ARMT model fine-tuned on SmolLM2 by `jaxlongctx train-armt --base smollm2 --chat
--freeze-base`: the memory-only model its `--save` writes, or one of its training checkpoints
(`<run>/checkpoints/step_*`, read by `jaxlongctx.train.armt_training_checkpoint`). Its base (SmolLM2,
in `--base-dtype`) is the full-attention model; the memory parameters stay float32, as trained.

Items: `jaxlongctx.data.chat_retrieval.retrieval_set`, held-out seeds, validation-split filler (the
evaluation filler; training draws from the train split), one planted fact per item, its depth cycling
through DEFAULT_DEPTHS (0.1 ... 0.9 of the document); prompt, answer prefix and code fit each length.
Score: exact match (all 4 code digits right) with its 95% Wilson interval, by teacher forcing: one
forward over prompt + answer prefix + the first 3 digits, the argmax at the 4 digit positions; all four
are right exactly when greedy decoding writes the code (`jaxlongctx.train.chat_accuracy`).

Rows:
(a) `full_attention`: SmolLM2 alone. It sees at most its native context (8,192 tokens with the code);
    a longer item is cut to fit: the chat frame's head (system turn, user turn start) is kept, then the
    item's last tokens: the end of the document, the question, the assistant turn's start and the answer
    prefix. The document's first tokens are dropped, so a fact planted there is lost.
(b) `armt_diagonal`: SmolLM2 + ARMT memory, as decoding reads the prompt: every segment before the
    prompt's last runs through the diagonal schedule (`ARMTModel.run_segments(..., "diagonal")`) writing
    the memory state, the prompt's last segment, the answer prefix and digits form the decoding window.
    On CPU the diagonal schedule of a one-shot input runs its cells in sequential order where the
    pipeline does not pay off (`diagonal_pays_off`; always for SmolLM2's 528-row segments): the JSON
    records how it ran (`diagonal_runs_as`). Each row lists per item its depth, where its code lies
    against the decoding window and whether it was answered, and `memory_only`: exact match over the
    items whose fact lies before the window, the ones only the memory can answer.
(c) `sequential_check`: the first `--sequential-samples` items of each `--sequential-lengths` length on
    the sequential schedule; whether its answers equal (b)'s, and the largest digit-logit difference.
    Where (b) ran in sequential order (CPU), the same items also run through the diagonal pipeline
    forced on (every diagonal one batched call), so that the schedules really differ.

Writes bench/results/armt_real_model.{json,png} (`--quick`: `_quick` files, never the full ones).
Cost on 2 shared CPU cores: a 512-token segment of SmolLM2 takes about 2-4 s, so an ARMT item of L tokens
takes about L / 512 x 3 s (64K: 6 minutes); the script prints an estimate first.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from bench.armt_retrieval import _exact_match_errorbar, _length_axis
from bench.common import plot_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.armt.cpu_execution import CPUExecution, diagonal_pays_off
from jaxlongctx.armt.model import ARMTModel
from jaxlongctx.data.chat_retrieval import DEFAULT_DEPTHS, RetrievalItem, retrieval_set
from jaxlongctx.data.haystack import CODE_DIGITS, DEFAULT_NOUN, FILLER_SPLIT, check_noun
from jaxlongctx.loading import load
from jaxlongctx.train.armt_finetune import memory_in_float32
from jaxlongctx.train.armt_training_checkpoint import (
    is_training_checkpoint,
    load_training_checkpoint,
    training_record,
)
from jaxlongctx.train.chat_accuracy import (
    PREFIX_CHUNK_SEGMENTS,
    answer_logits,
    argmax_digits,
    armt_digit_logits,
    chat_cut,
    exact_match,
    fact_in_window,
    fit_context,
    full_attention_digit_logits,
)
from jaxlongctx.train.evaluate import DIGIT_CHANCE

NAME = "armt_real_model"
NUM_FACTS = 1
DEFAULT_LENGTHS = "4096,8192,16384,32768,65536"
SECONDS_PER_SEGMENT = (2.0, 4.0)  # a 512-token SmolLM2 segment on 2 shared CPU cores (load 2-4)
QUICK = {"lengths": "1024,2048", "samples": 2, "sequential_samples": 1, "sequential_lengths": "1024"}


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, load the model and run the sweep."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", required=True, help="ARMT model directory or training checkpoint step_* directory"
    )
    p.add_argument(
        "--base-dtype", choices=("bf16", "fp32"), default="bf16", help="SmolLM2's weights (default bf16)"
    )
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated context lengths in tokens")
    p.add_argument("--samples", type=int, default=10, help="items per length (default 10: each depth twice)")
    p.add_argument("--sequential-samples", type=int, default=2, help="items per length for check (c)")
    p.add_argument(
        "--sequential-lengths",
        default=None,
        help="lengths of check (c) (default: those of --lengths up to the native context)",
    )
    p.add_argument(
        "--chunk-segments",
        type=int,
        default=PREFIX_CHUNK_SEGMENTS,
        help="prompt segments per schedule call (bounds the dropped logits; default %(default)s)",
    )
    p.add_argument(
        "--noun",
        help="what facts and questions call the code (default: the noun the model was trained on, as its "
        'record says, else "code")',
    )
    p.add_argument("--quick", action="store_true", help=f"a small run: {QUICK}, written to _quick files")
    p.add_argument(
        "--name", default=NAME, help=f"result files bench/results/<name>.{{json,png}} (default {NAME})"
    )
    args = p.parse_args(argv)
    use_quick_results(args.quick)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    lengths = parse_lengths(args.lengths, "--lengths")
    if args.samples < 1 or args.sequential_samples < 0:
        raise ValueError("--samples must be >= 1 and --sequential-samples >= 0")
    check_lengths = args.sequential_lengths and parse_lengths(args.sequential_lengths, "--sequential-lengths")
    if check_lengths and not set(check_lengths) <= set(lengths):
        raise ValueError(f"--sequential-lengths {check_lengths} must be among --lengths {lengths}")
    armt, model_info = load_armt(Path(args.model), args.base_dtype)
    noun = args.noun or trained_noun(model_info)
    check_noun(noun)
    native = armt.base.config.max_position_embeddings
    check_lengths = check_lengths or [n for n in lengths if n <= native]
    print_estimate(armt, lengths, args.samples, check_lengths, args.sequential_samples)
    result = run(
        armt, lengths, args.samples, check_lengths, args.sequential_samples, args.chunk_segments, noun
    )
    write_results(
        {**result, "model": model_info, "base_dtype": args.base_dtype, "quick": args.quick}, args.name
    )


def parse_lengths(text: str, name: str) -> list[int]:
    """Comma-separated positive integers, sorted."""
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise ValueError(f"{name} needs positive lengths, got {text!r}")
    return values


def load_armt(path: Path, base_dtype: str) -> tuple[ARMTModel, dict[str, Any]]:
    """The ARMT model at `path` (a saved model or a training checkpoint; memory in float32) and what the
    JSON records of it: the path, its kind and its training step / record."""
    if is_training_checkpoint(path):
        record = training_record(path)
        losses = record["history"]["loss"][-10:]
        info = {
            "kind": "training checkpoint",
            "step": record["step"],
            "total_steps": record["total_steps"],
            "hyperparams": record["hyperparams"],
            "mean_loss_last_10_steps": sum(losses) / len(losses) if losses else None,
        }
        return load_training_checkpoint(path, base_dtype), {"path": str(path), **info}
    armt = load(path, base_dtype)
    if not isinstance(armt, ARMTModel):
        raise ValueError(f"--model {path}: holds a {type(armt).__name__}, not an ARMT model")
    info: dict[str, Any] = {"path": str(path), "kind": "saved model"}
    record = path / "training.json"
    if record.is_file():
        runs = json.loads(record.read_text()).get("runs", [])
        info["training"] = [
            {
                **{k: run.get(k) for k in ("command", "steps", "curriculum", "final_loss", "train_wall_s")},
                "noun": run.get("noun") or run.get("hyperparams", {}).get("noun"),  # a run, or a checkpoint
            }
            for run in runs
        ]
    return memory_in_float32(armt), info


def trained_noun(model_info: dict[str, Any]) -> str:
    """The noun the model's facts were trained with: its training checkpoint's setting, or the last run
    of its training record that names one; "code" (the default) where none does."""
    if "hyperparams" in model_info:
        return model_info["hyperparams"].get("noun") or DEFAULT_NOUN
    nouns = [run["noun"] for run in model_info.get("training", []) if run.get("noun")]
    return nouns[-1] if nouns else DEFAULT_NOUN


def print_estimate(
    armt: ARMTModel, lengths: list[int], samples: int, check_lengths: list[int], check_samples: int
) -> None:
    """Print the segment forwards the run makes and the time they take at SECONDS_PER_SEGMENT."""
    S = armt.armt.segment_size
    segments = samples * sum(-(-n // S) for n in lengths)
    segments += check_samples * sum(-(-n // S) for n in check_lengths) * (3 if _cpu_pipeline_check() else 2)
    full = samples * sum(-(-min(n, armt.base.config.max_position_embeddings) // S) for n in lengths)
    total = segments + full
    low, high = (total * s / 60 for s in SECONDS_PER_SEGMENT)
    print(
        f"estimate: about {total:,} segment forwards of {S} tokens ({segments:,} ARMT, {full:,} full "
        f"attention), {low:.0f}-{high:.0f} minutes at {SECONDS_PER_SEGMENT[0]:g}-{SECONDS_PER_SEGMENT[1]:g} s "
        "each (2 shared CPU cores), plus compilation",
        flush=True,
    )


def _cpu_pipeline_check() -> bool:
    """Whether check (c) also forces the diagonal pipeline (on CPU, where (b) runs in sequential order)."""
    return jax.default_backend() == "cpu"


def _row(name: str, length: int, items: list[RetrievalItem], logits, seconds: float, load: float) -> dict:
    """One JSON row: exact match of `logits [N, CODE_DIGITS, V]` on `items`, time and load average."""
    row = {"length": length, **exact_match(argmax_digits(logits), items), "seconds": seconds}
    row.update(load_average_before=load, load_average_after=os.getloadavg()[0])
    print(name, {k: row[k] for k in ("length", "correct", "n", "accuracy", "seconds")}, flush=True)
    return row


def run(
    armt: ARMTModel,
    lengths: list[int],
    samples: int,
    check_lengths: list[int],
    check_samples: int,
    chunk_segments: int = PREFIX_CHUNK_SEGMENTS,
    noun: str = DEFAULT_NOUN,
) -> dict[str, Any]:
    """Rows (a) full attention and (b) ARMT diagonal at every length, and check (c) at `check_lengths`;
    the items' facts call the code `noun`."""
    tokenizer, native = armt.tokenizer, armt.base.config.max_position_embeddings
    cut = chat_cut(tokenizer, noun)
    full = full_attention_digit_logits(armt.base)
    diagonal = armt_digit_logits(armt, "diagonal", chunk_segments)
    rows: dict[str, list[dict]] = {"full_attention": [], "armt_diagonal": []}
    checks, runs_as = [], {}
    for length in lengths:
        items = retrieval_set(tokenizer, samples, length, num_facts=NUM_FACTS, noun=noun)
        fitted = [fit_context(item, cut, native) for item in items]
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        logits = answer_logits(full, fitted, f"full attention {length:,}")
        rows["full_attention"].append(
            {
                **_row("full_attention", length, items, logits, time.perf_counter() - t0, load0),
                "tokens_seen": max(int(f.prompt.size + f.answer_prefix.size + CODE_DIGITS) for f in fitted),
            }
        )
        segments = -(-length // armt.armt.segment_size)
        runs_as[length] = "pipeline" if diagonal_pays_off(armt, 1, segments) else "sequential order"
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        diag = answer_logits(diagonal, items, f"ARMT diagonal {length:,}")
        row = _row("armt_diagonal", length, items, diag, time.perf_counter() - t0, load0)
        rows["armt_diagonal"].append({**row, **by_fact_place(armt, items, diag)})
        if length in check_lengths and check_samples:
            checks.append(
                schedule_check(armt, items[:check_samples], diag[:check_samples], length, chunk_segments)
            )
    return {
        "settings": {
            "lengths": lengths,
            "samples": samples,
            "num_facts": NUM_FACTS,
            "noun": noun,
            "depths": list(DEFAULT_DEPTHS),
            "filler_split": FILLER_SPLIT,
            "seeds": "held out: eval_seed(0 .. samples - 1)",
            "native_context": native,
            "segment_size": armt.armt.segment_size,
            "segmentation": armt.segmentation,
            "chunk_segments": chunk_segments,
            "sequential_lengths": check_lengths,
            "sequential_samples": check_samples,
            "score": "teacher-forced argmax at the 4 digit positions (exact match = greedy decoding's)",
        },
        "chance": {"exact_match": DIGIT_CHANCE**CODE_DIGITS, "digit_accuracy": DIGIT_CHANCE},
        "diagonal_runs_as": runs_as,
        "results": rows,
        "sequential_check": checks,
    }


def by_fact_place(armt: ARMTModel, items: list[RetrievalItem], logits) -> dict[str, Any]:
    """Per item of an ARMT row: its depth, where its fact lies against the decoding window and whether
    it was answered; and exact match over the items whose fact lies before the window, which only the
    memory can answer (`memory_only`)."""
    places = [fact_in_window(armt, item) for item in items]
    predicted = argmax_digits(logits)  # [N, CODE_DIGITS]
    right = (predicted == np.stack([item.answer_ids for item in items])).all(axis=1)
    per_item = [
        {"depth": item.depth, **place, "correct": bool(ok)} for item, place, ok in zip(items, places, right)
    ]
    behind = [i for i, place in enumerate(places) if not place["fact_in_window"]]
    memory_only = exact_match(predicted[behind], [items[i] for i in behind]) if behind else {"n": 0}
    print("  fact before the decoding window:", {k: memory_only.get(k) for k in ("correct", "n")}, flush=True)
    return {"items": per_item, "memory_only": memory_only}


def schedule_check(
    armt: ARMTModel, items: list[RetrievalItem], diagonal_logits, length: int, chunk_segments: int
) -> dict[str, Any]:
    """Check (c): the sequential schedule's answers on `items` against the diagonal's (`diagonal_logits`
    `[N, CODE_DIGITS, V]`); on CPU also the diagonal pipeline forced on (all prompt segments in one call)."""
    t0 = time.perf_counter()
    seq = answer_logits(
        armt_digit_logits(armt, "sequential", chunk_segments), items, f"sequential {length:,}"
    )
    out = {
        "length": length,
        "n": len(items),
        "answers_equal": bool((argmax_digits(seq) == argmax_digits(diagonal_logits)).all()),
        "max_abs_digit_logit_difference": float(abs(seq - diagonal_logits).max()),
    }
    if _cpu_pipeline_check():
        saved = armt.cpu_execution
        rows = armt.config.num_layers * armt.armt.rows
        armt.cpu_execution = CPUExecution(batched_rows=rows, min_segments_per_layer=0)
        try:
            pipe = answer_logits(armt_digit_logits(armt, "diagonal", 1 << 30), items, f"pipeline {length:,}")
        finally:
            armt.cpu_execution = saved
        out["pipeline_answers_equal"] = bool((argmax_digits(pipe) == argmax_digits(seq)).all())
        out["pipeline_max_abs_digit_logit_difference"] = float(abs(pipe - seq).max())
    out["seconds"] = time.perf_counter() - t0
    print("sequential_check", out, flush=True)
    return out


def write_results(result: dict[str, Any], result_name: str = NAME) -> None:
    """The JSON and the plot (exact match and digit accuracy against length, chance, native context)
    as `bench/results/<result_name>.*`."""
    write_result(result_name, {**result, "plot": f"{result_name}.png"})
    native, chance = result["settings"]["native_context"], result["chance"]
    fig, axes = subplots(1, 2, figsize=(12, 4.5))
    labels = {
        "full_attention": f"SmolLM2 full attention (cut to {native:,})",
        "armt_diagonal": "SmolLM2 + ARMT memory (diagonal schedule)",
    }
    for name, rows in result["results"].items():
        n = rows[0]["n"]
        as_bars = [
            {"length": r["length"], "exact_match": r["accuracy"], "exact_match_ci95": r["interval"]}
            for r in rows
        ]
        _exact_match_errorbar(axes[0], as_bars, f"{labels[name]}, {n} per length")
        axes[1].plot(
            [r["length"] for r in rows], [r["digit_accuracy"] for r in rows], "o-", label=labels[name]
        )
    for ax, metric in zip(axes, ("exact_match", "digit_accuracy")):
        ax.axhline(chance[metric], color="gray", ls="--", lw=1, label=f"chance ({chance[metric]:g})")
        ax.annotate(
            f"chance {chance[metric]:g}",
            (0.01, chance[metric]),
            xycoords=("axes fraction", "data"),
            xytext=(0, 3),
            textcoords="offset points",
            fontsize=8,
            color="gray",
        )
        ax.axvline(native, color="black", ls=":", lw=1, label=f"native context ({native:,})")
        _length_axis(ax, metric + (" (bars: 95% Wilson interval)" if metric == "exact_match" else ""))
        ax.legend(fontsize=8)
    kind = result["model"]["kind"] + (
        f" at step {result['model']['step']}" if "step" in result["model"] else ""
    )
    fig.suptitle(
        f"chat haystack, one fact: exact match of the 4-digit code ({kind}{', quick' if result['quick'] else ''})"
    )
    save_plot(fig, plot_path(result_name), dpi=110)


if __name__ == "__main__":
    main()
