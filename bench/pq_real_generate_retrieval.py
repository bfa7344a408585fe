"""8K retrieval through `jaxlongctx.generate` with the PQ cache itself, on SmolLM2-135M-Instruct.

`bench.pq_real_model --part retrieval` measures the caches in an evaluation harness: the prompt's K/V
fake-quantized (decode(encode(.)) in float32), the answer prefix fed after it. This bench asks the
same held-out items through the product path: `jaxlongctx.generate` with `PQKV` (packed 4-bit codes
read by the native CPU kernel, the exact window and the pinned prompt tokens in the cache), the
prompt and answer prefix prefilled together, four digits decoded greedily, against `DenseKV`. The
caches: ds 1 4-bit per-layer attention-weighted codebooks from 8K calibration windows (the +1.4%
perplexity setting), with the first 4 tokens pinned and the prompt's tail exact, and the same with
256 tokens per layer and kv head that the prompt's last tokens attend to most also pinned (each scored
over the cache's span, `observed_tokens.SPAN`); with those tokens, ds 1 4-bit codebooks per layer and
kv head, and ds 2 8-bit per layer (`--only` picks caches). Each answer is also paired with the
harness's answer for the same item where a harness result file has it.

    python -m bench.pq_real_generate_retrieval [--samples 30] [--codebooks-dir D] [--points-per-centroid 1024]
        [--only NAME ...] [--name RESULT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS_DIR, plot_path, save_plot, subplots, use_quick_results, write_result
from bench.pq_real_model import (
    RECENT,
    SINKS,
    SYMMETRIC_SPAN,
    CodebookStore,
    bits_per_element,
    load_now,
    pq,
    retrieval_settings,
)
from jaxlongctx.train.evaluate import exact_match_interval

OBSERVED = 256
HARNESS_FILES = ("pq_real_retrieval_8k_number.json", "pq_real_retrieval_ppc1024_shard0of1_only*.json")


def settings(context: int) -> dict[str, Any]:
    """Name -> the `bench.pq_real_model` setting of each PQ cache (None: dense)."""
    base = pq(1, "layer", "attention", SINKS, RECENT, bits=4, calib_window=context)
    observed = pq(1, "layer", "attention", SINKS, RECENT, bits=4, calib_window=context, observed=OBSERVED)
    per_head = pq(
        1, "layer_head", "attention", SINKS, RECENT, bits=4, calib_window=context, observed=OBSERVED
    )
    ds2 = pq(2, "layer", "attention", SINKS, RECENT, calib_window=context, observed=OBSERVED)  # 8-bit codes
    return {"dense": None, **{s.name: s for s in (base, observed, per_head, ds2)}}


def harness_answers(names: list[str]) -> dict[tuple[int, str, str], str]:
    """(seed, true answer, setting) -> the evaluation harness's answer, from the committed retrieval
    results (keyed by the true answer too, so an item made another way is not paired)."""
    found: dict[tuple[int, str, str], str] = {}
    for pattern in HARNESS_FILES:
        for path in sorted(RESULTS_DIR.glob(pattern)):
            for item in json.loads(path.read_text()).get("items", []):
                for name in names:
                    if name in item["answers"]:
                        found[(item["seed"], item["answer"], name)] = item["answers"][name]
    return found


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--first-item", type=int, default=0)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--points-per-centroid", type=int, default=1024)
    p.add_argument("--codebooks-dir", default=str(Path.home() / ".cache" / "jaxlongctx" / "pq_real_model"))
    p.add_argument("--quick", action="store_true", help="2 items of 1K tokens, _quick result files")
    p.add_argument("--only", nargs="+", default=[], help="PQ caches to ask (by setting name; dense always)")
    p.add_argument("--name", default="pq_real_generate_retrieval", help="result file name")
    args = p.parse_args(argv)
    use_quick_results(args.quick)
    if args.quick:
        args.samples, args.context = 2, 1024

    from jaxlongctx import PQKV, DenseKV, SamplingParams, generate
    from jaxlongctx.data.chat_retrieval import retrieval_set
    from jaxlongctx.loading import load
    from jaxlongctx.pretrained import smollm2_gguf

    model = load(smollm2_gguf(), "fp32")
    store = CodebookStore(
        model, Path(args.codebooks_dir), args.context, 2 if args.quick else 25, args.points_per_centroid
    )
    caches: dict[str, Any] = {}
    bits: dict[str, float] = {}
    chosen = {n: s for n, s in settings(args.context).items() if s is None or not args.only or n in args.only}
    if args.only and len(chosen) != len(args.only) + 1:
        raise SystemExit(f"--only: each name must be one of {sorted(settings(args.context))[1:]}")
    for name, setting in chosen.items():
        if setting is None:
            caches[name], bits[name] = DenseKV(), 16.0
            continue
        cb = store.get(setting)
        caches[name] = PQKV(
            cb, RECENT, keep_prompt_tail_exact=True, sinks=setting.sinks, observed=setting.observed
        )
        bits[name] = round(bits_per_element(setting, model.config, args.context, cb), 4)
    harness = harness_answers(list(caches))
    items = retrieval_set(
        model.tokenizer,
        args.samples,
        args.context,
        first_index=args.first_item,
        num_facts=1,
        noun="secret number",
    )
    payload: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 weights, fp32)",
        "context": args.context,
        "caches": {n: {"bits_per_element": bits[n], "cache": repr(c)[:200]} for n, c in caches.items()},
        "protocol": "prompt + answer prefix prefilled, 4 digits greedy through jaxlongctx.generate; PQ: "
        f"window R={RECENT} with the prompt's tail exact ((n - 1) mod R + 1 tokens), pinned sinks and observed "
        "tokens; the harness's answers (bench.pq_real_model, the prompt's last R tokens exact, answer prefix "
        "decoded) paired where present",
        "quick": args.quick,
        "items": [],
    }
    for n, item in enumerate(items, 1):
        t0 = time.perf_counter()
        ids = np.concatenate([item.prompt, item.answer_prefix])[None].astype(np.int32)
        answers = {}
        for name, cache in caches.items():
            out = generate(model, ids, SamplingParams(4, stop_ids=()), cache=cache)
            answers[name] = model.tokenizer.decode(out[0, ids.shape[1] :].tolist())
        payload["items"].append(
            {
                "seed": item.seed,
                "depth": item.depth,
                "answer": item.answer,
                "answers": answers,
                "harness": {name: harness.get((item.seed, item.answer, name)) for name in caches},
                "seconds": round(time.perf_counter() - t0, 1),
                "load_avg": load_now(),
            }
        )
        print(f"item {n}/{len(items)} answer {item.answer}: {answers}", flush=True)
        payload["rows"] = summary(payload["items"], list(caches), bits)
        payload["complete"] = n == len(items)
        write_result(args.name, payload)  # after every item: a stopped run keeps them
    plot(payload, args.name)
    return payload


def summary(items: list[dict], names: list[str], bits: dict[str, float]) -> list[dict]:
    """Per cache: exact matches with a 95% interval, items paired with dense, and agreement with the harness."""
    dense = [it["answers"]["dense"] == it["answer"] for it in items]
    rows = []
    for name in names:
        hits = [it["answers"][name] == it["answer"] for it in items]
        paired = [it for it in items if it["harness"][name] is not None]
        rows.append(
            {
                "name": name,
                "bits_per_element": bits[name],
                "right": sum(hits),
                "samples": len(items),
                "interval_95": exact_match_interval(sum(hits), len(items)),
                "right_where_dense_wrong": sum(h and not d for h, d in zip(hits, dense)),
                "wrong_where_dense_right": sum(d and not h for h, d in zip(hits, dense)),
                "harness_items": len(paired),
                "harness_right": sum(it["harness"][name] == it["answer"] for it in paired),
                "same_answer_as_harness": sum(it["harness"][name] == it["answers"][name] for it in paired),
            }
        )
    return rows


def label(name: str) -> str:
    """A cache's name for a figure: 'PQ ds1 4-bit layer_head, sinks+R128, 256 observed'."""
    s = {x.name: x for x in retrieval_settings(8192)}.get(name) or settings(8192).get(name)
    if s is None or s.kind != "pq":
        return name
    observed = f", {s.observed} observed" + (" (symmetric span)" if s.observed_span == SYMMETRIC_SPAN else "")
    return f"PQ ds{s.ds} {s.bits}-bit {s.granularity}, sinks+R{s.recent}" + (observed if s.observed else "")


def plot(payload: dict, name: str) -> None:
    """Exact match per cache through generate, beside the harness's on the same items."""
    rows = payload["rows"]
    fig, ax = subplots(figsize=(10, 3))
    y = np.arange(len(rows))
    ax.barh(y + 0.2, [r["right"] / r["samples"] for r in rows], 0.4, label="jaxlongctx.generate (the cache)")
    ax.barh(
        y - 0.2,
        [r["harness_right"] / max(r["harness_items"], 1) for r in rows],
        0.4,
        label="evaluation harness (fake quantization)",
    )
    ax.set_yticks(y, [f"{label(r['name'])} ({r['bits_per_element']:.2f} bits)" for r in rows], fontsize=7)
    ax.set_xlim(0, 1)
    ax.set_xlabel("exact match")
    ax.set_title(
        f"SmolLM2-135M, {payload['context']:,}-token chat retrieval, {rows[0]['samples']} items", fontsize=10
    )
    ax.legend(fontsize=7, loc="lower right")
    save_plot(fig, plot_path(name), dpi=120, rect=(0.03, 0, 1, 1))  # room for the longest label


if __name__ == "__main__":
    main()
