"""What an ARMT fine-tune's memory carries, on held-out samples drawn as its training draws them.

    python -m bench.armt_memory_probe --model CKPT [CKPT ...] [--lengths 512,1024] [--samples 40] [--quick]

`bench.armt_real_model` scores a model the way a user meets it (facts at any depth, the prompt's last
segment kept open for decoding). Early in a curriculum that says little: a memory trained only on
facts just before the first segment boundary is asked there about facts it never saw placed. This
probe asks it what it was taught: chat haystacks from `haystack_batch(near_fraction=1.0)` (the asked
fact in the last quarter of the first segment), validation-split filler and held-out seeds, every
segment through the diagonal schedule as in training (`ARMTModel.run_segments`), the digits scored by
teacher forcing at the answer positions. Items whose code lands in the answer's own segment
(attention can read it) are counted apart; `memory_only` covers the rest, the items only the memory
can answer: exact match (all 4 digits) with its 95% Wilson interval, digit accuracy overall and per
digit position (chance 0.1).

`--model` takes saved ARMT models or training checkpoints (`<run>/checkpoints/step_*`), several to
compare steps. Writes bench/results/armt_memory_probe.{json,png} (`--name` to choose; `--quick`: a
smoke run to _quick files). Cost: one forward over 2 x L tokens per batch, about 3-4 s per 512 tokens
of SmolLM2 on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from bench.armt_real_model import load_armt, parse_lengths, trained_noun
from bench.common import environment, plot_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.armt.segments import Segments
from jaxlongctx.armt.sentences import make_segmenter
from jaxlongctx.data.haystack import CODE_DIGITS, DEFAULT_NOUN, chat_frame, eval_seed
from jaxlongctx.train.armt_finetune import answer_logits, haystack_batch
from jaxlongctx.train.chat_accuracy import code_position
from jaxlongctx.train.evaluate import exact_match_interval

BATCH = 2
QUICK = {"lengths": [512], "samples": 2}


def probe_length(armt: Any, tokens: int, samples: int, noun: str = DEFAULT_NOUN) -> dict[str, Any]:
    """Digit hits of `samples` near-boundary items of `tokens` tokens (the code called `noun`), split by
    where the code lies."""
    frame = chat_frame(armt.tokenizer, noun)
    segmenter = make_segmenter(armt.segmentation, armt.tokenizer)
    size = armt.armt.segment_size
    memory_hits, window_hits = [], []
    start = time.perf_counter()
    for b in tqdm(range(-(-samples // BATCH)), desc=f"probe {tokens:,}", unit="batch"):
        batch = haystack_batch(
            eval_seed(b),
            BATCH,
            tokens,
            armt.tokenizer,
            size,
            1,
            chat=frame,
            near_fraction=1.0,
            filler_split="validation",
            segmenter=segmenter,
            noun=noun,
        )
        segments = Segments(batch["seg_ids"], batch["seg_n"], batch["seg_first"])
        _, logits = armt.run_segments(armt.params, segments, "diagonal")
        slots = batch.get("slots")
        digits = answer_logits(
            logits, jnp.asarray(batch["answer_pos"]), None if slots is None else jnp.asarray(slots)
        )
        predicted = np.asarray(digits).argmax(-1)  # B K
        for i in range(min(BATCH, samples - b * BATCH)):
            code = batch["answer_ids"][i, :CODE_DIGITS]
            where = [code_position(batch["ids"][i], code), int(batch["answer_pos"][i, 0])]
            if slots is not None:
                where = [int(slots[i, w]) for w in where]
            hits = (predicted[i, :CODE_DIGITS] == code).tolist()
            (window_hits if where[0] // size == where[1] // size else memory_hits).append(hits)
    return {
        "tokens": tokens,
        "items": samples,
        "noun": noun,
        "memory_only": score(memory_hits),
        "fact_in_answer_segment": score(window_hits),
        "seconds": time.perf_counter() - start,
    }


def score(hits: list[list[bool]]) -> dict[str, Any]:
    """Exact match and digit accuracy of per-item digit hits `[n, CODE_DIGITS]`."""
    if not hits:
        return {"n": 0}
    h = np.asarray(hits, dtype=bool)
    exact = int(h.all(axis=1).sum())
    return {
        "n": len(hits),
        "exact": exact,
        "accuracy": exact / len(hits),
        "interval": exact_match_interval(exact, len(hits)),
        "digit_accuracy": float(h.mean()),
        "per_digit": h.mean(axis=0).round(3).tolist(),
    }


def label(info: dict[str, Any]) -> str:
    """A short name of a probed model for the plot: its run (or directory) and training step."""
    path = Path(info["path"])
    if "step" not in info:
        return path.name
    run = path.parent.parent.name if path.parent.name == "checkpoints" else path.name
    return f"{run}\nstep {info['step']}"


def plot(payload: dict[str, Any], name: str) -> Path:
    """Memory-only digit accuracy per model and length, with chance."""
    fig, ax = subplots(figsize=(7, 4))
    models = payload["models"]
    lengths = payload["lengths"]
    width = 0.8 / len(lengths)
    for j, tokens in enumerate(lengths):
        values = [next(r for r in m["rows"] if r["tokens"] == tokens)["memory_only"] for m in models]
        xs = np.arange(len(models)) + (j - (len(lengths) - 1) / 2) * width
        ax.bar(xs, [v.get("digit_accuracy", 0.0) for v in values], width, label=f"{tokens:,} tokens")
    ax.axhline(payload["chance_digit"], color="grey", linestyle=":", label="chance")
    ax.set_xticks(np.arange(len(models)), [label(m["model"]) for m in models])
    ax.set_ylim(0, 1)
    ax.set_ylabel("digit accuracy, facts only the memory holds")
    ax.set_title("ARMT memory probe: fact just before the first boundary")
    ax.legend()
    return save_plot(fig, plot_path(name))


def main(argv: list[str] | None = None) -> None:
    """Probe each `--model` at each length and write the JSON (after every model) and the plot."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", required=True, help="saved ARMT models or training checkpoints")
    p.add_argument("--lengths", default="512,1024", help="comma-separated sample lengths in tokens")
    p.add_argument("--samples", type=int, default=40, help="items per length (default 40)")
    p.add_argument("--base-dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--name", default="armt_memory_probe", help="result file name")
    p.add_argument(
        "--noun", help="what the facts call the code (default: each model's training noun, else 'code')"
    )
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}, written to _quick files")
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error(f"--samples must be >= 1, got {args.samples}")
    use_quick_results(args.quick)
    try:
        lengths = QUICK["lengths"] if args.quick else parse_lengths(args.lengths, "--lengths")
    except ValueError as e:
        p.error(str(e))
    samples = QUICK["samples"] if args.quick else args.samples
    payload: dict[str, Any] = {
        "name": args.name,
        "environment": environment(),
        "lengths": lengths,
        "samples": samples,
        "seeds": f"held out: eval_seed(batch index), batches of {BATCH}",
        "placement": "near_fraction 1.0: the fact in the last quarter of the first segment",
        "filler_split": "validation",
        "base_dtype": args.base_dtype,
        "chance_digit": 0.1,
        "quick": args.quick,
        "models": [],
    }
    for path in args.model:
        armt, info = load_armt(Path(path), args.base_dtype)
        noun = args.noun or trained_noun(info)
        rows = [probe_length(armt, tokens, samples, noun) for tokens in lengths]
        name = " ".join(label(info).split())
        for row in rows:
            print(f"{name} {row['tokens']:,}: memory only {row['memory_only']}")
        payload["models"].append({"model": info, "rows": rows})
        write_result(args.name, payload)
    payload["plot"] = str(plot(payload, args.name))
    write_result(args.name, payload)


if __name__ == "__main__":
    main()
