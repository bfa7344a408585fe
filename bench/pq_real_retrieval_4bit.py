"""8K SmolLM2 retrieval at about 4 bits per element: every measured 4-bit row beside dense, one figure.

The retrieval runs of `bench.pq_real_model --part retrieval` for single settings (`--only`, on codebooks
from 1,024 calibration vectors a centroid) have no dense row of their own; their items are the held-out
seeds of the full run (`pq_real_retrieval_8k_number.json`), whose dense answers they are paired with
here, item by item (seed and true answer must agree). The per-layer ds 2 row and int4 come from that
run itself (ds 2 codebooks from 64 vectors a centroid; the later ds 2 rows, from every calibration
vector). Writes `bench/results/pq_real_retrieval_4bit.{json,png}`: per row, exact matches with a 95%
interval, bits per element, and the items it gets that dense misses and misses that dense gets.

    python -m bench.pq_real_retrieval_4bit
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS_DIR, plot_path, save_plot, subplots, write_result
from jaxlongctx.train.evaluate import exact_match_interval

DENSE_FILE = "pq_real_retrieval_8k_number.json"
OBSERVED_0_29 = "pq_real_retrieval_ppc1024_shard0of1_onlya03957f7.json"
FROM_30 = "pq_real_retrieval_ppc1024_shard0of1_from30_onlyfa6467bd.json"
OTHER_KINDS = "pq_real_retrieval_ppc1024_shard0of1_only419b8d2d.json"  # per head, ds 2: 256 observed
ROWS = (  # (row, label, the runs that answered it); ds 1 codebooks from 1,024 vectors a centroid
    ("int4 g128 R128", "int4 g128, R128", (DENSE_FILE,)),
    ("pq ds2 layer weighted sink4 R128 cal8K", "ds2 8-bit, layer, weighted, sinks+R128", (DENSE_FILE,)),
    (
        "pq ds1 layer weighted sink4 R128 4-bit cal8K",
        "ds1 4-bit, layer, weighted, sinks+R128",
        ("pq_real_retrieval_ppc1024_shard0of1_only93be3877.json", FROM_30),
    ),
    (
        "pq ds1 layer_head weighted sink4 R128 4-bit cal8K",
        "ds1 4-bit, layer+head, weighted, sinks+R128",
        ("pq_real_retrieval_ppc1024_shard0of1_onlyaa3465ef.json",),
    ),
    (
        "pq ds1 layer weighted sink4 R128 4-bit cal8K obs256",
        "+ 256 observed, symmetric span",
        (OBSERVED_0_29, FROM_30),
    ),
    (
        "pq ds1 layer_head weighted sink4 R128 4-bit cal8K obs256",
        "layer+head + 256 observed, symmetric span",
        ("pq_real_retrieval_ppc1024_shard0of1_onlyaa3465ef.json",),
    ),
    (
        "pq ds1 layer weighted sink4 R128 4-bit cal8K obs256 span8+2",
        "+ 256 observed, span 8 before, 2 after",
        ("pq_real_retrieval_ppc1024_shard0of1_only429ecaf2.json",),
    ),
    (
        "pq ds1 layer weighted sink4 R128 4-bit cal8K obs128 span8+2",
        "+ 128 observed, span 8+2",
        ("pq_real_retrieval_ppc1024_shard0of1_only6034c026.json",),
    ),
    (
        "pq ds1 layer_head weighted sink4 R128 4-bit cal8K obs256 span8+2",
        "layer+head + 256 observed, span 8+2",
        (OTHER_KINDS,),
    ),
    (  # the ds 2 codebooks of the two rows below: 1,024 vectors a centroid (every calibration vector)
        "pq ds2 layer weighted sink4 R128 cal8K",
        "ds2 8-bit, layer, weighted, sinks+R128, all vectors",
        (OTHER_KINDS,),
    ),
    (
        "pq ds2 layer weighted sink4 R128 cal8K obs256 span8+2",
        "ds2 8-bit, layer + 256 observed, span 8+2",
        (OTHER_KINDS,),
    ),
)


def right(answer: str, truth: str) -> bool:
    """Exact match of a decoded answer (its first four characters, as the retrieval bench scores)."""
    return answer.strip().startswith(truth)


def paired_rows(dense: list[dict], rows: list[tuple[str, str, list[dict]]]) -> list[dict]:
    """Per (name, label, runs) of `rows`: the row's answers in its runs (result payloads) on the items
    of `dense` (items with a "dense" answer), exact matches, 95% interval, bits per element and the
    discordant pairs with dense."""
    truth = {it["seed"]: (it["answer"], right(it["answers"]["dense"], it["answer"])) for it in dense}
    everything = [ok for _, ok in truth.values()]
    out = [_row("dense", "dense", 16.0, everything, everything)]
    for name, label, runs in rows:
        answers: dict[int, bool] = {}
        described = [
            s for run in runs for s in run.get("settings", []) + run.get("rows", [])
        ]  # shard / merged
        bits = {s["bits_per_element"] for s in described if s["name"] == name}
        for run in runs:
            for it in run["items"]:
                if name in it["answers"] and it["seed"] in truth:
                    if truth[it["seed"]][0] != it["answer"]:
                        raise ValueError(f"item {it['seed']} has another answer than the dense run's")
                    answers[it["seed"]] = right(it["answers"][name], it["answer"])
        if not answers or len(bits) != 1:
            raise ValueError(f"{name!r}: {len(answers)} items answered, bits per element {bits}")
        seeds = sorted(answers)
        out.append(_row(name, label, bits.pop(), [answers[s] for s in seeds], [truth[s][1] for s in seeds]))
    return out


def _row(name: str, label: str, bits: float | None, hits: list[bool], dense: list[bool]) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "bits_per_element": bits,
        "right": sum(hits),
        "samples": len(hits),
        "interval_95": exact_match_interval(sum(hits), len(hits)),
        "right_where_dense_wrong": sum(h and not d for h, d in zip(hits, dense)),
        "wrong_where_dense_right": sum(d and not h for h, d in zip(hits, dense)),
    }


def plot(payload: dict, name: str) -> None:
    """Exact match per row with its 95% interval, dense's rate and the 3-point goal band marked."""
    rows = payload["rows"]
    fig, ax = subplots(figsize=(10, 1.0 + 0.28 * len(rows)))
    y = np.arange(len(rows))[::-1]
    rate = np.array([r["right"] / r["samples"] for r in rows])
    low, high = (np.array([r["interval_95"][i] for r in rows]) for i in (0, 1))
    ax.barh(y, rate, color=["0.5" if r["name"] == "dense" else "tab:blue" for r in rows])
    ax.errorbar(rate, y, xerr=[rate - low, high - rate], fmt="none", ecolor="k", capsize=2, lw=0.8)
    ax.axvline(rate[0], color="0.3", lw=0.8, ls="--")
    ax.axvspan(rate[0] - 0.03, rate[0], color="tab:green", alpha=0.15, label="within 3 points of dense")
    labels = [
        f"{r['label']} ({r['bits_per_element']:.2f} bits) +{r['right_where_dense_wrong']}/-{r['wrong_where_dense_right']}"
        if r["name"] != "dense"
        else "dense (16 bits)"
        for r in rows
    ]
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlim(0, 1)
    ax.set_xlabel("exact match (95% interval); +/-: items dense misses / gets")
    ax.set_title(f"SmolLM2-135M, 8K-token chat retrieval, {rows[0]['samples']} held-out items", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    save_plot(fig, plot_path(name), dpi=120, rect=(0.02, 0, 1, 1))  # room for the longest label


def main(results: Path = RESULTS_DIR, name: str = "pq_real_retrieval_4bit") -> dict:
    load = lambda f: json.loads((results / f).read_text())
    dense = [it for it in load(DENSE_FILE)["items"] if "dense" in it["answers"]]
    payload = {
        "protocol": "8K chat retrieval items (noun 'secret number'), every row paired by seed with the dense "
        f"answers of {DENSE_FILE}",
        "runs": {label: list(files) for _, label, files in ROWS},
        "rows": paired_rows(dense, [(n, label, [load(f) for f in files]) for n, label, files in ROWS]),
    }
    write_result(name, payload)
    plot(payload, name)
    return payload


if __name__ == "__main__":
    main()
