"""PQ KV-cache quality on SmolLM2-135M-Instruct at equal bits: perplexity and 8K-context retrieval.

Perplexity (`--part ppl`): validation split, windows of 2K and 8K tokens, every token's post-RoPE K/V
quantized in every layer, for dense, the KIVI-style uniform baseline (int4/int2, groups of 128, with
and without an exact recent window) and PQ (ds 2 and 4, 8-bit codes, shared / layer / layer_head
codebooks), then each improvement on its own and all together: attention-weighted k-means and
encoding, exact attention-sink tokens, an exact recent window. Bits per element include the
codebooks, scales, zero points and exact tokens.

Retrieval (`--part retrieval`): a held-out chat retrieval set in SmolLM2's native 8K context (facts
planted at several depths in validation-split text), one full-precision prefill per item, then the
answer decoded greedily over each quantized prompt cache; exact match with 95% Wilson intervals.

Codebooks are calibrated on the calibration split only and kept in `--codebooks-dir` (reused when
present). Writes bench/results/pq_real_model.json + .png and pq_real_retrieval.json + .png after
every row; `--quick` writes the `_quick` files.

    python -m bench.pq_real_model [--part ppl|retrieval|all] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import plot_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.kvcache.observed_tokens import SPAN

RECENT = 128  # exact recent window (MILLION's R, KIVI's residual)
SINKS = 4  # exact first tokens
OBSERVED_EXACT = (64, 256)  # prompt tokens per layer and kv head the question attends to, kept exact
SYMMETRIC_SPAN = (3, 3)  # SnapKV's 7-token pooling, which the first observed-token rows used
CALIBRATION_KEYS = ("calib_tokens", "kmeans_iters", "points_per_centroid")  # a run's k-means settings
GROUP = 128  # KIVI group size


@dataclass(frozen=True)
class Setting:
    """One K/V format: kind dense / int4 / int2 / pq, PQ codebook choice, and the exact tokens kept."""

    name: str
    kind: str
    ds: int = 0
    granularity: str = ""
    weighting: str = "none"
    sinks: int = 0
    recent: int = 0
    bits: int = 8  # PQ code width (8: 256 centroids per subspace)
    calib_window: int = 512  # tokens per calibration window (post-RoPE keys are seen up to this position)
    observed: int = 0  # prompt tokens per layer and kv head kept exact for the question (retrieval only)
    observed_span: tuple[int, int] = SPAN  # positions before and after a token its score is pooled over

    @property
    def codebook_key(self) -> str:
        """Name of the codebooks this setting uses ("" for none)."""
        if self.kind != "pq":
            return ""
        wide = f"_b{self.bits}" if self.bits != 8 else ""
        window = f"_w{self.calib_window}" if self.calib_window != 512 else ""
        return f"ds{self.ds}_{self.granularity}_{self.weighting}{wide}{window}"


def pq(
    ds: int,
    granularity: str,
    weighting: str = "none",
    sinks: int = 0,
    recent: int = 0,
    bits: int = 8,
    calib_window: int = 512,
    observed: int = 0,
    observed_span: tuple[int, int] = SPAN,
) -> Setting:
    """A PQ setting named after its parts ("cal8K": codebooks from 8,192-token calibration windows;
    "obs256": 256 observed tokens scored over SnapKV's symmetric 7-token span, which the first runs
    used, "obs256 span8+2" over the 8 tokens before and 2 after)."""
    extras = [
        w
        for w, on in (
            ("weighted", weighting != "none"),
            (f"sink{sinks}", sinks),
            (f"R{recent}", recent),
            (f"{bits}-bit", bits != 8),
            (
                f"cal{calib_window // 1024}K" if calib_window % 1024 == 0 else f"cal{calib_window}",
                calib_window != 512,
            ),
            (f"obs{observed}", observed),
            (f"span{observed_span[0]}+{observed_span[1]}", observed and observed_span != SYMMETRIC_SPAN),
        )
        if on
    ]
    name = " ".join([f"pq ds{ds} {granularity}", *extras])
    return Setting(
        name, "pq", ds, granularity, weighting, sinks, recent, bits, calib_window, observed, observed_span
    )


def ppl_settings(context: int) -> list[Setting]:
    """The rows of the perplexity table at `context`, most telling first (a time-boxed run keeps
    those): every row at 2K; at 8K the baselines with their recent window, the main PQ rows and the
    per-head codebooks that keep 8K retrieval answers (`retrieval_settings`)."""
    best2, best4 = pq(2, "layer", "attention", SINKS, RECENT), pq(4, "layer", "attention", SINKS, RECENT)
    int4r = Setting(f"int4 g128 R{RECENT}", "int4", recent=RECENT)
    int2r = Setting(f"int2 g128 R{RECENT}", "int2", recent=RECENT)
    # codebooks calibrated on windows as long as the evaluated one: keys are quantized after RoPE, and
    # 512-token windows never show the k-means a key rotated past position 512
    w = context
    rows = [
        Setting("dense", "dense"),
        int4r,
        int2r,
        pq(2, "layer", "attention", SINKS, RECENT, calib_window=w),
        pq(4, "layer", "attention", SINKS, RECENT, calib_window=w),
        pq(4, "layer", "attention", SINKS, RECENT, bits=10, calib_window=w),  # 2.5 bits/element of codes
        pq(2, "layer", calib_window=w),
        pq(4, "layer", calib_window=w),
        best2,  # 512-token calibration windows, as the first runs
        pq(2, "layer"),
        best4,
        pq(4, "layer"),
    ]
    if context > 2048:  # an 8K window costs about 4x a 2K one; a wider exact window costs little there
        wider = [pq(4, "layer", "attention", SINKS, r, calib_window=w) for r in (2 * RECENT, 4 * RECENT)]
        int2_wider = Setting(f"int2 g128 R{2 * RECENT}", "int2", recent=2 * RECENT)
        return rows + wider + [int2_wider] + per_head_settings(w) + packed_settings(w)
    return rows + [
        pq(2, "layer", "attention"),  # each improvement on its own
        pq(2, "layer", recent=RECENT),
        pq(2, "layer", sinks=SINKS),
        Setting("int4 g128", "int4"),  # every token quantized, as the plain PQ rows
        Setting("int2 g128", "int2"),
        pq(4, "layer", "attention"),
        pq(2, "shared"),
        pq(4, "shared"),
        pq(2, "layer_head"),
        pq(4, "layer_head"),
    ]


def per_head_settings(calib_window: int) -> list[Setting]:
    """Per-layer-and-head ds 2 codebooks from `calib_window`-token windows: every token quantized; the
    first 4 and last 128 tokens exact, together and each alone; 7- and 6-bit codes (at 8K their
    codebooks cost 0.5 and 0.25 bits per element, 1.0 for 8-bit codes; codes stay a byte each, so they
    store 4.5 and 4.25 bits in all, the 6-bit row as many as the int4 baseline); 6-bit codes with the
    exact tokens (about 4.4 bits at 8K)."""
    w = calib_window
    return [
        pq(2, "layer_head", calib_window=w),
        pq(2, "layer_head", "none", SINKS, RECENT, calib_window=w),
        pq(2, "layer_head", "none", SINKS, calib_window=w),
        pq(2, "layer_head", "none", recent=RECENT, calib_window=w),
        pq(2, "layer_head", bits=7, calib_window=w),
        pq(2, "layer_head", bits=6, calib_window=w),
        pq(2, "layer_head", "none", SINKS, RECENT, bits=6, calib_window=w),
    ]


def packed_settings(calib_window: int) -> list[Setting]:
    """4-bit codes (16 centroids a subspace, stored two a byte), which the CPU decode kernel scores in
    vector registers: ds 1 (4 bits per element) and ds 2 (2 bits), per layer, every token quantized and
    with the first 4 and last 128 tokens exact; ds 2 with the last 256 and 512 exact; ds 1 with
    codebooks per layer and head (16 levels per channel of each kv head), with those exact tokens."""
    w = calib_window
    return [
        *(
            pq(ds, "layer", *exact, bits=4, calib_window=w)
            for ds in (1, 2)
            for exact in (("attention", SINKS, RECENT), ("none",))
        ),
        *(pq(2, "layer", "attention", SINKS, r, bits=4, calib_window=w) for r in (2 * RECENT, 4 * RECENT)),
        pq(1, "layer_head", "attention", SINKS, RECENT, bits=4, calib_window=w),
    ]


def retrieval_settings(context: int) -> list[Setting]:
    """Dense, 4-bit PQ with every prompt token quantized and with the exact tokens of the perplexity
    table's best setting, each with codebooks from 512-token and from `context`-token calibration
    windows, the per-head rows of `per_head_settings`, ds 1 with packed 4-bit codes (4 bits per element)
    with and without those exact tokens and with the `OBSERVED_EXACT` tokens per layer and kv head that
    the prompt's last tokens attend to most also exact, ds 1 per layer and head with those exact tokens
    (and the most observed ones), ds 1 per layer (256 and 128 tokens), ds 1 per layer and head and ds 2
    8-bit per layer with observed tokens scored over `SPAN`, and the int4 baseline with and without the recent window; the decoded tokens are exact in every
    cache."""
    packed = ("attention", SINKS, RECENT, 4, context)  # weighting, sinks, recent, bits, calib_window
    return [
        Setting("dense", "dense"),
        pq(2, "layer"),
        pq(2, "layer", "attention", SINKS, RECENT),
        pq(2, "layer", calib_window=context),
        pq(2, "layer", "attention", SINKS, RECENT, calib_window=context),
        *per_head_settings(context),
        pq(1, "layer", "attention", SINKS, RECENT, bits=4, calib_window=context),  # 4 bits, packed codes
        pq(1, "layer", bits=4, calib_window=context),
        *(  # and the tokens the question attends to exact, scored over SnapKV's symmetric span
            pq(1, "layer", *packed, observed=n, observed_span=SYMMETRIC_SPAN) for n in OBSERVED_EXACT
        ),
        *(  # 16 levels per channel of each kv head (+1.9% perplexity at 8K), alone and with those tokens
            pq(1, "layer_head", *packed, observed=n, observed_span=SYMMETRIC_SPAN)
            for n in (0, max(OBSERVED_EXACT))
        ),
        # observed tokens scored over the span that reaches the tokens after an attended one, with each
        # 4-bit codebook kind: ds 1 per layer, ds 1 per layer and head, ds 2 8-bit per layer
        pq(1, "layer", *packed, observed=max(OBSERVED_EXACT)),
        pq(1, "layer", *packed, observed=128),  # half the budget
        pq(1, "layer_head", *packed, observed=max(OBSERVED_EXACT)),
        pq(2, "layer", "attention", SINKS, RECENT, calib_window=context, observed=max(OBSERVED_EXACT)),
        Setting("int4 g128", "int4"),
        Setting(f"int4 g128 R{RECENT}", "int4", recent=RECENT),
    ]


def bits_per_element(setting: Setting, config: Any, tokens: int, codebooks: Any = None) -> float:
    """Stored bits per cached K/V element at `tokens` tokens: codes, codebooks (fp32), encode weights,
    group scales and zero points (fp16), exact tokens (bf16)."""
    from jaxlongctx.kvcache.pq_cache import pq_cache_report
    from jaxlongctx.kvcache.uniform_quant import effective_bits

    if setting.kind == "dense":
        return 16.0
    exact = min(tokens, setting.sinks + setting.recent + setting.observed)
    # observed tokens are chosen per layer and kv head: each stores its position (int32)
    positions = 32 * setting.observed / (2 * config.head_dim * tokens)
    if setting.kind != "pq":
        coded_bits = effective_bits(int(setting.kind[3:]), GROUP)
        return ((tokens - exact) * coded_bits + exact * 16) / tokens
    report = pq_cache_report(config, codebooks, tokens, exact)
    weights = 0 if not codebooks.weighted else 4 * (codebooks.key_weights.size + codebooks.value_weights.size)
    elements = 2 * config.num_layers * config.num_kv_heads * tokens * config.head_dim
    return report["bits_per_element"] + 8 * weights / elements + positions


class CodebookStore:
    """Codebooks per setting: loaded from `folder` when there, else calibrated (timed) and saved."""

    def __init__(self, model: Any, folder: Path, calib_tokens: int, iters: int, ppc: int):
        self.model, self.folder, self.calib_tokens, self.iters, self.ppc = (
            model,
            folder,
            calib_tokens,
            iters,
            ppc,
        )
        self._cache: dict[str, Any] = {}

    def seconds(self) -> dict[str, float]:
        """Calibration seconds of every codebook used so far (recorded when it was calibrated)."""
        return {key: cb.metadata.get("calibration_seconds", -1.0) for key, cb in self._cache.items()}

    def get(self, setting: Setting) -> Any:
        """The codebooks of a PQ setting."""
        from jaxlongctx.data.tokenizer import encode_corpus
        from jaxlongctx.kvcache.calibrate import calibrate
        from jaxlongctx.kvcache.codebooks import save_codebooks
        from jaxlongctx.kvcache.model_codebooks import load_codebooks_for

        key = setting.codebook_key
        if key in self._cache:
            return self._cache[key]
        # wider codes calibrate on proportionally more text (the same vectors per centroid as 8-bit
        # ones), and on at least one calibration window
        tokens = max(self.calib_tokens * 2 ** max(0, setting.bits - 8), setting.calib_window)
        path = self.folder / f"{key}_t{tokens}_i{self.iters}_p{self.ppc}"
        claim = path.with_name(path.name + ".calibrating")  # another run of this bench is making them
        while claim.exists() and not path.is_dir():
            time.sleep(10)
        if path.is_dir():
            cb = load_codebooks_for(self.model, path)
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            claim.touch()
            t0 = time.perf_counter()
            cb = calibrate(
                self.model,
                encode_corpus("calibration", self.model.tokenizer),
                setting.ds,
                setting.bits,
                setting.granularity,
                self.iters,
                seq_len=setting.calib_window,
                max_tokens=tokens,
                points_per_centroid=self.ppc,
                tol=1e-3,
                weighting=setting.weighting,
                source="calibration split",
            )
            seconds = round(time.perf_counter() - t0, 1)
            cb = dataclasses.replace(
                cb, metadata={**cb.metadata, "calibration_seconds": seconds, "load_avg": str(load_now())}
            )
            print(f"calibrated {key} in {seconds} s (load {load_now()})", flush=True)
            save_codebooks(cb, path, overwrite=False)
            claim.unlink()
        self._cache[key] = cb
        return cb


def transform_of(setting: Setting, codebooks: Any) -> Any:
    """The K/V fake quantization of a setting (None for dense), sinks kept exact."""
    from jaxlongctx.kv_quality import kv_transform
    from jaxlongctx.kvcache.exact_window import keep_sinks_exact

    transform = kv_transform(setting.kind, codebooks, GROUP)
    return (
        keep_sinks_exact(transform, setting.sinks) if transform is not None and setting.sinks else transform
    )


def load_now() -> list[float]:
    """The 1/5/15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def shard_name(name: str, shard: tuple[int, int], only: list[str] = (), first_item: int = 0) -> str:
    """Result name of one shard of a run split over processes (`--part merge` combines them); a run
    of `--only` some rows or settings, or of later retrieval items (`--first-item`), gets a name of
    its own, so it adds to the full run's shards."""
    import hashlib

    index, count = shard
    tag = "_only" + hashlib.sha1("|".join(sorted(only)).encode()).hexdigest()[:8] if only else ""
    later = f"_from{first_item}" if first_item else ""
    return f"{name}_shard{index}of{count}{later}{tag}"


def run_ppl(model: Any, store: CodebookStore, args: argparse.Namespace, config: dict) -> dict:
    """This shard's rows of the perplexity table; the JSON is rewritten after every row."""
    from jaxlongctx.data.tokenizer import encode_corpus
    from jaxlongctx.train.evaluate import perplexity

    val = encode_corpus("validation", model.tokenizer)
    index, count = args.shard
    rows: list[dict] = []
    payload = {
        "config": {**config, "eval_tokens": dict(zip(map(str, args.contexts), args.eval_tokens))},
        "rows": rows,
    }
    for context, n_tokens in zip(args.contexts, args.eval_tokens):
        chosen = [s for s in ppl_settings(context) if s.name in args.only] if args.only else None
        for setting in chosen or ppl_settings(context)[index::count]:
            cb = store.get(setting) if setting.kind == "pq" else None
            t0 = time.perf_counter()
            result = perplexity(
                model.module, val[:n_tokens], context, 1, transform_of(setting, cb), setting.recent
            )
            row = {
                **asdict(setting),
                "context": context,
                "bits_per_element": round(bits_per_element(setting, model.config, context, cb), 4),
                **result,
                "seconds": round(time.perf_counter() - t0, 1),
                "load_avg": load_now(),
            }
            rows.append(row)
            print(
                f"{context:5d} {setting.name:32s} {row['bits_per_element']:6.3f} b  ppl {row['ppl']:.3f}  "
                f"{row['seconds']} s  load {row['load_avg']}",
                flush=True,
            )
            payload["config"]["calibration_seconds"] = store.seconds()
            payload["complete"] = False
            write_result(shard_name(args.name, args.shard, args.only), payload)
    payload["complete"] = True
    write_result(shard_name(args.name, args.shard, args.only), payload)
    return payload


def run_retrieval(model: Any, store: CodebookStore, args: argparse.Namespace, config: dict) -> dict:
    """This shard's retrieval items, each prefilled once and answered over every cache."""
    from jaxlongctx.data.chat_retrieval import retrieval_set
    from jaxlongctx.kv_retrieval import PromptCache, answer
    from jaxlongctx.kvcache.observed_tokens import OBSERVE

    index, count = args.shard
    items = retrieval_set(
        model.tokenizer,
        args.samples,
        args.retrieval_context,
        first_index=args.first_item,
        num_facts=args.retrieval_facts,
        noun=args.retrieval_noun,
    )[index::count]
    settings = [s for s in retrieval_settings(args.retrieval_context) if not args.only or s.name in args.only]
    if not settings:
        raise SystemExit(f"--only names no retrieval setting: {args.only}")
    transforms: dict[str, Any] = {}  # made at first use, so the first prefill need not wait for codebooks
    bits: dict[str, float] = {}
    payload: dict[str, Any] = {
        "config": {
            **config,
            "context": args.retrieval_context,
            "facts": args.retrieval_facts,
            "noun": args.retrieval_noun,
        },
        "items": [],
    }
    for n, item in enumerate(items, 1):
        t0 = time.perf_counter()
        observe = OBSERVE if any(s.observed for s in settings) else 0  # the question's last tokens
        prompt_cache = PromptCache(model, item.prompt, args.retrieval_context, observe=observe)
        prefill_s = time.perf_counter() - t0
        answers = {}
        for s in settings:
            if s.name not in transforms:
                cb = store.get(s) if s.kind == "pq" else None
                transforms[s.name] = transform_of(s, cb)
                bits[s.name] = round(bits_per_element(s, model.config, args.retrieval_context, cb), 4)
            digits = answer(
                model,
                prompt_cache,
                item,
                transforms[s.name],
                recent_exact=s.recent,
                observed_exact=s.observed,
                observed_span=s.observed_span,
            )
            answers[s.name] = model.tokenizer.decode([int(d) for d in digits])
        payload["items"].append(
            {
                "seed": item.seed,
                "depth": item.depth,
                "prompt_tokens": int(item.prompt.size),
                "answer": item.answer,
                "answers": answers,
                "prefill_s": round(prefill_s, 1),
                "seconds": round(time.perf_counter() - t0, 1),
                "load_avg": load_now(),
            }
        )
        payload["settings"] = [{**asdict(s), "bits_per_element": bits[s.name]} for s in settings]
        payload["complete"] = n == len(items)
        print(
            f"item {n}/{len(items)} depth {item.depth} answer {item.answer}: {answers} "
            f"({payload['items'][-1]['seconds']} s, load {load_now()})",
            flush=True,
        )
        ret_name = args.name.replace("pq_real_model", "pq_real_retrieval")
        write_result(shard_name(ret_name, args.shard, args.only, args.first_item), payload)
    return payload


def merge(name: str) -> dict:
    """Combine the shard files of `name` (and `<name>_8k`) into `<name>.json` and the retrieval shards
    into `pq_real_retrieval.json`, with ratios to dense, Wilson intervals and plots."""
    import json

    from bench.common import RESULTS_DIR, result_name
    from jaxlongctx.train.evaluate import exact_match_interval

    def parts(stem: str) -> list[dict]:
        pattern = result_name(stem + "_shard*of*")
        files = sorted(RESULTS_DIR.glob(f"{pattern}.json"))
        if not pattern.endswith("_quick"):  # the glob also matches quick runs' shards
            files = [f for f in files if not f.stem.endswith("_quick")]
        return [json.loads(f.read_text()) for f in files]

    ppl_parts = parts(name)
    extra = RESULTS_DIR / f"{result_name(name + '_8k')}.json"
    if extra.is_file():
        ppl_parts.append(json.loads(extra.read_text()))
    out: dict[str, Any] = {}
    if ppl_parts:
        for part in ppl_parts:  # parts ran with different k-means settings: each row keeps its own
            for r in (r for r in part["rows"] if r["kind"] == "pq"):
                r["calibration"] = {k: part["config"][k] for k in CALIBRATION_KEYS if k in part["config"]}
        rows = list({(r["context"], r["name"]): r for part in ppl_parts[::-1] for r in part["rows"]}.values())
        order = {(c, s.name): i for c in (2048, 8192) for i, s in enumerate(ppl_settings(c))}
        rows.sort(key=lambda r: (r["context"], order.get((r["context"], r["name"]), 99)))
        for row in rows:
            dense = [r["ppl"] for r in rows if r["context"] == row["context"] and r["kind"] == "dense"]
            row["ppl_vs_dense"] = row["ppl"] / dense[0] if dense else None
        config = {**ppl_parts[0]["config"], "eval_tokens": {}}
        for part in ppl_parts:
            config["eval_tokens"].update(part["config"]["eval_tokens"])
            config["calibration_seconds"] = {
                **config.get("calibration_seconds", {}),
                **part["config"].get("calibration_seconds", {}),
            }
        complete = all(part.get("complete") for part in ppl_parts)
        out["ppl"] = {"config": config, "rows": rows, "complete": complete}
        write_result(name, out["ppl"])
        _plot_ppl(rows, plot_path(name))
    ret_parts = parts(name.replace("pq_real_model", "pq_real_retrieval"))
    if ret_parts:
        items = _items_by_seed(ret_parts)
        settings = list({s["name"]: s for part in ret_parts for s in part["settings"]}.values())
        order = {s.name: i for i, s in enumerate(retrieval_settings(ret_parts[0]["config"]["context"]))}
        settings.sort(key=lambda s: order.get(s["name"], len(order)))
        # a setting counts on the items every part answered it on (an --only run may cover fewer)
        settings = [s for s in settings if all(s["name"] in i["answers"] for i in items)]
        if not all("dense" in i["answers"] for i in items):
            raise SystemExit(
                "--part merge: the retrieval runs answer some items without the dense cache, which every "
                "setting is paired with; run them with dense (--only dense ...) or keep their shard files"
            )
        rows = []
        dense_hits = [i["answers"]["dense"] == i["answer"] for i in items]
        depths = sorted({i["depth"] for i in items})
        for s in settings:
            hits = [i["answers"][s["name"]] == i["answer"] for i in items]
            rows.append(
                {
                    **s,
                    "right": sum(hits),
                    "samples": len(items),
                    "accuracy": sum(hits) / len(items),
                    "interval_95": exact_match_interval(sum(hits), len(items)),
                    # paired with dense on the same items: the accuracy gap and where it comes from
                    "points_vs_dense": 100.0 * (sum(hits) - sum(dense_hits)) / len(items),
                    "right_where_dense_wrong": sum(h and not d for h, d in zip(hits, dense_hits)),
                    "wrong_where_dense_right": sum(d and not h for h, d in zip(hits, dense_hits)),
                    "by_depth": {
                        str(d): [h for h, i in zip(hits, items) if i["depth"] == d].count(True)
                        / sum(i["depth"] == d for i in items)
                        for d in depths
                    },
                }
            )
        ret_name = name.replace("pq_real_model", "pq_real_retrieval")
        complete = all(part.get("complete") for part in ret_parts)
        out["retrieval"] = {
            "config": ret_parts[0]["config"],
            "rows": rows,
            "items": items,
            "complete": complete,
        }
        write_result(ret_name, out["retrieval"])
        _plot_retrieval(rows, plot_path(ret_name), out["retrieval"]["config"])
    return out


def _items_by_seed(parts: list[dict]) -> list[dict]:
    """The retrieval items of every part, one per seed with the answers of every part that ran it."""
    by_seed: dict[int, dict] = {}
    for part in parts:
        for item in part["items"]:
            seen = by_seed.setdefault(item["seed"], {**item, "answers": {}})
            if seen["answer"] != item["answer"]:
                raise ValueError(f"retrieval parts disagree on the answer of seed {item['seed']}")
            seen["answers"].update(item["answers"])
    return [by_seed[seed] for seed in sorted(by_seed)]


def _colour(kind: str) -> str:
    """A K/V format's colour in the plots: dense gray, the uniform baselines orange, PQ blue."""
    return "gray" if kind == "dense" else "tab:orange" if kind.startswith("int") else "tab:blue"


def _plot_ppl(rows: list[dict], path: Path) -> None:
    """Perplexity against stored bits per element, one panel per context."""
    contexts = sorted({r["context"] for r in rows})
    fig, axes = subplots(1, len(contexts), figsize=(7 * len(contexts), 5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        part = [r for r in rows if r["context"] == context]
        dense = part[0]["ppl"]
        for r in part:
            ax.scatter(r["bits_per_element"], r["ppl"], color=_colour(r["kind"]), s=18)
            ax.annotate(
                r["name"],
                (r["bits_per_element"], r["ppl"]),
                fontsize=6,
                xytext=(3, 2),
                textcoords="offset points",
            )
        for factor, style in ((1.02, "--"), (1.08, ":")):
            ax.axhline(dense * factor, color="gray", ls=style, lw=1, label=f"dense +{factor - 1:.0%}")
        ax.set_yscale("log")
        ax.set_xlabel("stored bits per K/V element (codebooks, scales, exact tokens included)")
        ax.set_ylabel("validation perplexity")
        ax.set_title(f"SmolLM2-135M, {context}-token windows")
        ax.legend(fontsize=7)
    save_plot(fig, path, dpi=120)


def _plot_retrieval(rows: list[dict], path: Path, config: dict) -> None:
    """Exact-match accuracy per cache with 95% Wilson intervals, one horizontal bar per cache."""
    fig, ax = subplots(figsize=(9, 1.2 + 0.38 * len(rows)))
    acc = [r["accuracy"] for r in rows]
    low = [r["accuracy"] - r["interval_95"][0] for r in rows]
    high = [r["interval_95"][1] - r["accuracy"] for r in rows]
    ax.barh(range(len(rows)), acc, xerr=[low, high], capsize=3, color=[_colour(r["kind"]) for r in rows])
    ax.set_yticks(
        range(len(rows)), [f"{r['name']} ({r['bits_per_element']:.2f} b)" for r in rows], fontsize=8
    )
    ax.invert_yaxis()
    dense = [r["accuracy"] for r in rows if r["kind"] == "dense"]
    if dense:
        ax.axvline(dense[0], color="gray", ls="--", lw=1, label="dense")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xlim(0, 1)
    ax.set_xlabel("exact match (95% Wilson interval)")
    noun = config.get("noun", "code")
    ax.set_title(
        f"SmolLM2-135M chat retrieval, {config['context']:,}-token prompts,\n{rows[0]['samples']} held-out "
        f'items ("the {noun} of ...")',
        fontsize=10,
    )
    save_plot(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    """Run the requested parts and write their result files."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--part",
        choices=["calibrate", "ppl", "retrieval", "merge", "all"],
        default="all",
        help="calibrate: only make the codebooks (of --ds, --weightings) the other parts use; "
        "merge: combine the results of runs split by --shard",
    )
    p.add_argument(
        "--only",
        nargs="+",
        default=[],
        help="ppl rows or retrieval settings to run, by name (default: this shard's rows, every setting)",
    )
    p.add_argument(
        "--shard",
        default="0/1",
        help="I/N: this process runs every N-th table row (ppl) or item (retrieval) from the I-th; "
        "--part merge then combines the shard files",
    )
    p.add_argument("--ds", type=int, nargs="+", default=[2, 4], help="subspace sizes --part calibrate makes")
    p.add_argument(
        "--weightings", nargs="+", default=["none", "attention"], help="weightings --part calibrate makes"
    )
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument(
        "--eval-tokens", type=int, nargs="+", default=[8192, 16384], help="validation tokens per context"
    )
    p.add_argument("--samples", type=int, default=30, help="retrieval items")
    p.add_argument(
        "--first-item",
        type=int,
        default=0,
        help="index of the first retrieval item (held-out seed); a later run from --samples on adds "
        "new items to the same set",
    )
    p.add_argument("--retrieval-context", type=int, default=8192)
    p.add_argument(
        "--retrieval-facts",
        type=int,
        default=1,
        help="facts planted per retrieval item (default 1; SmolLM2-135M answered none of 2 items with 4)",
    )
    p.add_argument(
        "--retrieval-noun",
        default="secret number",
        help='what the facts call their number (default "secret number"; with "code", the wording of the '
        "runs of 5 December, SmolLM2-135M answers most items with a ``` fence)",
    )
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--points-per-centroid", type=int, default=64)
    p.add_argument("--codebooks-dir", default=str(Path.home() / ".cache" / "jaxlongctx" / "pq_real_model"))
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, _quick result files")
    p.add_argument("--name", default="pq_real_model")
    args = p.parse_args(argv)
    use_quick_results(args.quick)
    index, _, count = args.shard.partition("/")
    args.shard = (int(index), int(count or 1))
    if not 0 <= args.shard[0] < args.shard[1]:
        raise SystemExit(f"--shard must be I/N with 0 <= I < N, got {args.shard}")
    if args.part == "merge":
        return merge(args.name)
    if args.quick:
        args.contexts, args.eval_tokens, args.samples = [256, 512], [512, 1024], 2
        args.retrieval_context, args.calib_tokens, args.iters = 1024, 1024, 2
    if len(args.eval_tokens) != len(args.contexts):
        raise SystemExit("--eval-tokens needs one count per --contexts entry")

    from jaxlongctx.loading import load
    from jaxlongctx.pretrained import smollm2_gguf

    model = load(smollm2_gguf(), "fp32")
    store = CodebookStore(
        model, Path(args.codebooks_dir), args.calib_tokens, args.iters, args.points_per_centroid
    )
    config = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 weights, fp32)",
        "calib_tokens": args.calib_tokens,
        "kmeans_iters": args.iters,
        "points_per_centroid": args.points_per_centroid,
        "bits": "8 per code unless a row says otherwise (its bits)",
        "kivi_group": GROUP,
        "recent_window": RECENT,
        "sinks": SINKS,
        "quick": args.quick,
        "protocol": "codebooks from the calibration split; perplexity and retrieval filler from the validation split",
    }
    out = {}
    if args.part == "calibrate":
        for setting in {
            s.codebook_key: s for s in ppl_settings(2048) + retrieval_settings(args.retrieval_context)
        }.values():
            if setting.kind == "pq" and setting.ds in args.ds and setting.weighting in args.weightings:
                store.get(setting)
    if args.part in ("ppl", "all"):
        out["ppl"] = run_ppl(model, store, args, config)
    if args.part in ("retrieval", "all"):
        out["retrieval"] = run_retrieval(model, store, args, config)
    if args.part == "all":
        merge(args.name)
    return out


if __name__ == "__main__":
    main()
