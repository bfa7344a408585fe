"""Where one SmolLM2 decode step goes on this CPU, per operation, beside the read-bandwidth ceiling.

    python -m bench.decode_profile [--quick] [--context 512] [--steps 32] [--rounds 5]

For fp32 and bf16 weights, `generate`'s compiled decode step (a filled cache of `--context` tokens) is
timed over `--steps` steps in interleaved rounds (median), then traced once with `jax.profiler`. Each
traced operation of the compiled step is put in one category by its HLO: the weight products by the
kernel call and its shapes (the RMSNorms run in their prologues), the attention over the cache, the
head over the vocabulary, and the XLA operations between them by the JAX function they come from
(sampling, the final norm, RoPE, the MLP's SiLU, the rest: residual adds, dtype rounding, cache writes,
the layer loop). Milliseconds per step per category, and each product's weight bytes per second,
against the read bandwidth measured between the same rounds (a float32 sum over 1 GiB, XLA's).
Writes bench/results/decode_profile.{json,png} (`--name` picks another stem, e.g. per host kind).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxlongctx
from bench.common import interleaved_times, plot_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.decode_loop import Request, bucket_length
from jaxlongctx.generate import _compiled
from jaxlongctx.pretrained import smollm2_gguf
from pallas_kernels import native_build

READ_BYTES = 2**30
CATEGORIES = (
    "q/k/v products (+ input norm)",
    "o product",
    "gate/up products (+ post norm)",
    "down product",
    "attention over the cache",
    "head (49,152 tokens)",
    "final norm",
    "sampling",
    "RoPE",
    "SiLU",
    "other XLA glue",
)


def step_runner(model: Any, context: int, steps: int):
    """A function that runs `steps` decode steps of `generate`'s compiled step from a filled cache of
    `context` random tokens, and the step's compiled HLO text."""
    ids = np.random.default_rng(context).integers(3, model.config.vocab_size, (1, context)).astype(np.int32)
    req = Request.parse(model, ids, jaxlongctx.SamplingParams(steps, stop_ids=()), None)
    ids_p, mask_p = req.padded_prompt()
    prefill, step = _compiled(model, bucket_length(ids_p.shape[1] + steps), *req.static_key)
    weights = model.params
    logits0, cache0 = prefill(weights, jnp.asarray(ids_p), jnp.asarray(mask_p))
    key, done = jax.random.key(0), jnp.zeros((1,), bool)
    positions = [jnp.array([context + i], jnp.int32) for i in range(steps)]
    slots = [jnp.int32(ids_p.shape[1] + i) for i in range(steps)]  # made before the clock starts

    def run() -> Any:
        cache, logits = jax.tree.map(jnp.copy, cache0), logits0  # the step donates its cache
        for i in range(steps):
            _, _, logits, cache = step(weights, cache, logits, key, done, positions[i], slots[i])
        return logits

    hlo = step.lower(weights, cache0, logits0, key, done, positions[0], slots[0]).compile().as_text()
    return run, hlo


def frame_functions(hlo: str) -> dict[int, str]:
    """Stack frame id -> the Python function an instruction was traced in (the HLO text's frame tables)."""
    tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
    section = ""
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
        elif section and (m := re.match(r"(\d+) (.*)", line)):
            tables[section][int(m.group(1))] = m.group(2)
        else:
            section = ""
    names = {}
    for frame, entry in tables["StackFrames"].items():
        location = tables["FileLocations"][int(re.search(r"file_location_id=(\d+)", entry).group(1))]
        names[frame] = tables["FunctionNames"][int(re.search(r"function_name_id=(\d+)", location).group(1))]
    return names


def classify(hlo: str, vocab: int) -> dict[str, str]:
    """HLO instruction name -> category, for the instructions a trace times (fusions, kernel calls)."""
    out = {}
    frames = frame_functions(hlo)
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)", line)
        if not m:
            continue
        name, rest = m.groups()
        op_name = re.search(r'op_name="([^"]*)"', rest)
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        source = (
            (op_name.group(1) if op_name else "")
            + " "
            + (frames.get(int(frame.group(1)), "") if frame else "")
        )
        if "custom_call_target" in rest:
            shape = rest.split(" custom-call(")[0]
            if "decode_attention" in rest:
                out[name] = "attention over the cache"
            elif f",{vocab}]" in shape:
                out[name] = "head (49,152 tokens)"
            elif shape.count("f32[") == 3:
                out[name] = "q/k/v products (+ input norm)"
            elif shape.count("f32[") == 2:
                out[name] = "gate/up products (+ post norm)"
            elif "f32[1,1536]" in rest.split("custom-call(")[1].split("operand_layout_constraints={")[1][:20]:
                out[name] = "down product"
            else:
                out[name] = "o product"
        elif " while(" in rest:
            continue  # the layer loop: its operations are timed one by one
        elif any(s in source for s in ("select_next", "choose_next", "argmax", "isin")):
            out[name] = "sampling"
        elif "rms_norm" in source:
            out[name] = "final norm"
        elif "rope" in source or "apply_rope" in source:
            out[name] = "RoPE"
        elif "silu" in source or "logistic" in source:
            out[name] = "SiLU"
        else:
            out[name] = "other XLA glue"
    return out


def traced_ms(run, categories: dict[str, str], steps: int) -> dict[str, float]:
    """Milliseconds per step per category from one traced run (the operations' own times)."""
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        jax.block_until_ready(run())
        jax.profiler.stop_trace()
        with gzip.open(next(Path(tmp).glob("plugins/profile/*/*.trace.json.gz"))) as f:
            trace = json.load(f)
    totals: dict[str, float] = collections.defaultdict(float)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e["name"] in categories:
            totals[categories[e["name"]]] += e["dur"] / 1e3
    return {c: totals.get(c, 0.0) / steps for c in CATEGORIES}


def product_bytes(model: Any) -> dict[str, int]:
    """Weight bytes each product category reads per step."""
    c = model.config
    item = model.dtype.itemsize
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    per_layer = {
        "q/k/v products (+ input norm)": d * (c.num_heads + 2 * c.num_kv_heads) * hd,
        "o product": c.num_heads * hd * d,
        "gate/up products (+ post norm)": 2 * d * f,
        "down product": f * d,
    }
    out = {k: v * c.num_layers * item for k, v in per_layer.items()}
    out["head (49,152 tokens)"] = c.vocab_size * d * item
    return out


def main() -> None:
    """Profile the fp32 and bf16 steps and write the breakdown."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 steps, 3 rounds")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--name", default="decode_profile", help="result file stem")
    args = p.parse_args()
    use_quick_results(args.quick)
    steps, rounds = (8, 3) if args.quick else (args.steps, args.rounds)
    buf = jnp.ones((READ_BYTES // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    models = {dtype: jaxlongctx.load(smollm2_gguf(), dtype) for dtype in ("fp32", "bf16")}
    runs, hlos = {}, {}
    for dtype, model in models.items():
        runs[dtype], hlos[dtype] = step_runner(model, args.context, steps)
    t = interleaved_times({**runs, "read": lambda: total(buf)}, repeats=rounds)
    read_bytes_per_s = READ_BYTES / t["read"]["min_s"]  # the best repeat: noise only slows a read
    rows = []
    for dtype, model in models.items():
        per_op = traced_ms(runs[dtype], classify(hlos[dtype], model.config.vocab_size), steps)
        step_ms = t[dtype]["median_s"] / steps * 1e3
        weight_bytes = model.param_bytes()
        rows.append(
            {
                "dtype": dtype,
                "step_ms": step_ms,
                "tokens_per_s": 1e3 / step_ms,
                "weight_bytes": weight_bytes,
                "ceiling_tokens_per_s": read_bytes_per_s / weight_bytes,
                "fraction_of_ceiling": (1e3 / step_ms) / (read_bytes_per_s / weight_bytes),
                "traced_ms_per_step": per_op,
                "traced_total_ms": sum(per_op.values()),
                # the step's time outside every traced operation: host dispatch, the loop, waits
                "untraced_ms": step_ms - sum(per_op.values()),
                "product_bytes_per_s": {
                    k: b / (per_op[k] / 1e3) for k, b in product_bytes(model).items() if per_op[k] > 0
                },
            }
        )
        print(
            f"{dtype}: {step_ms:.1f} ms/step ({1e3 / step_ms:.1f} tok/s, {rows[-1]['fraction_of_ceiling']:.0%} "
            f"of the {rows[-1]['ceiling_tokens_per_s']:.0f} tok/s ceiling at {read_bytes_per_s / 1e9:.1f} GB/s)"
        )
        for k, v in per_op.items():
            print(f"    {k:34s} {v:6.2f} ms")
        print(f"    {'outside the traced operations':34s} {rows[-1]['untraced_ms']:6.2f} ms")
    write_result(
        args.name,
        {
            "context": args.context,
            "steps": steps,
            "rounds": rounds,
            "kernel_march": native_build.march(),
            "read_bytes_per_s": read_bytes_per_s,
            "raw_times": t,
            "results": rows,
        },
    )
    plot(rows, read_bytes_per_s, args.name)


def plot(rows: list[dict[str, Any]], read_bytes_per_s: float, name: str) -> None:
    """Stacked bars: milliseconds per step per category, with the read-bandwidth floor of each step."""
    fig, ax = subplots(1, 1, figsize=(9, 4.5))
    colors = [f"C{i % 10}" for i in range(len(CATEGORIES))]
    for i, row in enumerate(rows):
        left = 0.0
        for c, color in zip(CATEGORIES, colors):
            v = row["traced_ms_per_step"][c]
            ax.barh(i, v, left=left, color=color, label=c if i == 0 else None)
            left += v
        floor = row["weight_bytes"] / read_bytes_per_s * 1e3
        ax.plot([floor, floor], [i - 0.4, i + 0.4], "k--", label="read floor" if i == 0 else None)
        ax.text(left, i, f" {row['step_ms']:.1f} ms/step", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r["dtype"] for r in rows])
    ax.set_xlabel("milliseconds per decode step (traced)")
    ax.set_title("SmolLM2-135M decode step by operation")
    ax.legend(fontsize=7, loc="lower right")
    save_plot(fig, plot_path(name), dpi=100)


if __name__ == "__main__":
    main()
