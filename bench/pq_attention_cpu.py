"""PQ decode attention on CPU (native kernel and XLA path) vs exact decode attention: time and bytes per step.

Llama-3-8B attention shapes (32 query heads, 8 kv heads, head dim 128), batch 1, one decode step.
The context is N tokens: N - R coded tokens plus a full exact window of R = 128 tokens (bf16).
PQ: 8-bit codes (C = 256) with ds = 2 (M = 64) and ds = 4 (M = 32), shared codebooks, through the
native CPU kernel (`backend="native"`, what "auto" takes on CPU) and the XLA gather path (`"xla"`).
Exact: `jax.nn.dot_product_attention` over an N-token cache in bf16 (and fp32 for context).

Usage: python -m bench.pq_attention_cpu [--quick]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import interleaved_times, plot_path, save_plot, subplots, use_quick_results, write_result
from pallas_kernels import pq_decode_attention

HEADS, KV_HEADS, HEAD_DIM, CENTROIDS, WINDOW = 32, 8, 128, 256, 128
SUB_DIMS = (2, 4)
CONTEXTS_FULL = (1024, 2048, 4096, 8192, 16384, 32768)
CONTEXTS_QUICK = (1024, 4096, 16384)
PQ_BACKENDS = ("native", "xla")


def pq_name(sub_dim: int, backend: str) -> str:
    """Result key of PQ attention at `sub_dim` through `backend`."""
    return f"pq_ds{sub_dim}_{backend}"


PQ_METHODS = tuple(pq_name(d, b) for d in SUB_DIMS for b in PQ_BACKENDS)


def pq_bytes(context: int, sub_dim: int) -> int:
    """Bytes one decode step reads: K and V codes, the bf16 exact window, both codebooks, and the LUT."""
    subspaces = HEAD_DIM // sub_dim
    codes = 2 * (context - WINDOW) * KV_HEADS * subspaces  # uint8
    window = 2 * WINDOW * KV_HEADS * HEAD_DIM * 2  # bf16
    codebooks = 2 * subspaces * CENTROIDS * sub_dim * 4  # fp32
    lut = HEADS * subspaces * CENTROIDS * 4  # fp32, built per step and read back
    return codes + window + codebooks + lut


def exact_bytes(context: int, itemsize: int) -> int:
    """Bytes one exact decode step reads: the whole K and V cache."""
    return 2 * context * KV_HEADS * HEAD_DIM * itemsize


def _pq_case(rng: np.random.Generator, context: int, sub_dim: int) -> tuple[jax.Array, ...]:
    """Random codes/codebooks/window for one PQ decode step (the values do not change the cost)."""
    subspaces = HEAD_DIM // sub_dim
    coded = context - WINDOW
    codes = lambda: jnp.asarray(rng.integers(0, CENTROIDS, (1, KV_HEADS, coded, subspaces)), jnp.uint8)
    cent = lambda: jnp.asarray(rng.standard_normal((subspaces, CENTROIDS, sub_dim)), jnp.float32)
    window = lambda: jnp.asarray(rng.standard_normal((1, KV_HEADS, WINDOW, HEAD_DIM)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((1, HEADS, HEAD_DIM)), jnp.bfloat16)
    return (
        q,
        codes(),
        codes(),
        cent(),
        cent(),
        jnp.array([coded], jnp.int32),
        window(),
        window(),
        jnp.array([WINDOW], jnp.int32),
    )


def measure(context: int, repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    """Time PQ (ds 2 and 4) and exact attention side by side at one context length."""
    scale = HEAD_DIM**-0.5
    pq = {
        backend: jax.jit(lambda *a, backend=backend: pq_decode_attention(*a, scale, backend=backend))
        for backend in PQ_BACKENDS
    }
    exact = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale))
    fns: dict[str, Any] = {}
    for sub_dim in SUB_DIMS:
        args = _pq_case(rng, context, sub_dim)
        for backend in PQ_BACKENDS:
            fns[pq_name(sub_dim, backend)] = lambda args=args, backend=backend: pq[backend](*args)
    k = jnp.asarray(rng.standard_normal((1, context, KV_HEADS, HEAD_DIM)), jnp.bfloat16)  # [B N K D]
    v = jnp.asarray(rng.standard_normal((1, context, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((1, 1, HEADS, HEAD_DIM)), jnp.bfloat16)  # [B 1 H D]
    q32, k32, v32 = (a.astype(jnp.float32) for a in (q, k, v))
    fns["exact_bf16"] = lambda: exact(q, k, v)
    fns["exact_fp32"] = lambda: exact(q32, k32, v32)
    times = interleaved_times(fns, repeats=repeats)
    row: dict[str, Any] = {
        "context": context,
        "times": times,
        "bytes": {
            "exact_bf16": exact_bytes(context, 2),
            "exact_fp32": exact_bytes(context, 4),
            **{pq_name(d, b): pq_bytes(context, d) for d in SUB_DIMS for b in PQ_BACKENDS},
        },
    }
    for exact in ("exact_bf16", "exact_fp32"):
        row[f"pq_time_over_{exact}"] = {
            m: times[m]["median_s"] / times[exact]["median_s"] for m in PQ_METHODS
        }
    row["pq_bytes_over_exact_bf16"] = {
        f"pq_ds{d}": pq_bytes(context, d) / exact_bytes(context, 2) for d in SUB_DIMS
    }
    return row


def plot(rows: list[dict[str, Any]], name: str) -> None:
    """Median time and bytes per decode step against context length."""
    contexts = [r["context"] for r in rows]
    fig, (ax_t, ax_b) = subplots(1, 2, figsize=(11, 4))
    for method in ("exact_bf16", "exact_fp32", *PQ_METHODS):
        ax_t.plot(contexts, [r["times"][method]["median_s"] * 1e3 for r in rows], marker="o", label=method)
        ax_b.plot(contexts, [r["bytes"][method] / 2**20 for r in rows], marker="o", label=method)
    for ax, label in ((ax_t, "median time per step (ms)"), (ax_b, "bytes read per step (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"PQ decode attention (native kernel, XLA) vs exact on CPU, H={HEADS} K={KV_HEADS} D={HEAD_DIM}"
    )
    save_plot(fig, plot_path(name), dpi=120)


NOTES = (
    "Native kernel (pallas_kernels/pq_attention_cpu.cc, the CPU default): one pass per (row, kv head, 4 "
    "query heads, token split), 16-byte LUT loads that score 4 query heads at once, an online softmax, "
    "and a per-centroid weight histogram for the values; bounded by the histogram's read-add-writes, "
    "not by memory bandwidth. "
    "XLA path (the notes below are its measurements). PQ reads 4x (ds 2) / 8x (ds 4) fewer bytes than exact bf16 but is not faster here: "
    "XLA:CPU runs the LUT lookup as a scalar gather (G*M = 256 (ds 2) / 128 (ds 4) gathered fp32 per "
    "token per kv head for the scores, plus M centroid sub-vectors per token for the values), each "
    "costing a few ns of index arithmetic and a dependent load, while exact attention streams 2*D "
    "contiguous bf16 values per token through vectorised dot products. On 2 CPU cores the gather "
    "throughput, not memory bandwidth, bounds the PQ step, so the byte saving does not turn into time. "
    "Layout choices that were measured and kept: the LUT is built once per step (one einsum), scores "
    "gather with take_along_axis over a flat [M*C] row per query head (faster than gathering G-wide rows), "
    "values gather [T, M, ds] centroid slices then do one matmul (about 2.5x faster than a scatter-add "
    "histogram over centroids). The GPU kernel (pallas_kernels/pq_attention_kernel.py) is where the "
    "byte saving should pay off."
)


def main() -> None:
    """Run the sweep, print ratios, write JSON + PNG."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 context lengths up to 16K, 5 repeats")
    args = parser.parse_args()
    use_quick_results(args.quick)
    contexts = CONTEXTS_QUICK if args.quick else CONTEXTS_FULL
    repeats = 5 if args.quick else 7
    rng = np.random.default_rng(0)
    rows = []
    for context in contexts:
        row = measure(context, repeats, rng)
        rows.append(row)
        t = {m: f"{v['median_s'] * 1e3:.1f}ms" for m, v in row["times"].items()}
        r = {m: f"{v:.2f}" for m, v in row["pq_time_over_exact_bf16"].items()}
        print(f"context {context:6d}: {t}  pq/exact_bf16 time {r}", flush=True)
    name = "pq_attention_cpu"
    write_result(
        name,
        {
            "config": {
                "heads": HEADS,
                "kv_heads": KV_HEADS,
                "head_dim": HEAD_DIM,
                "centroids": CENTROIDS,
                "window": WINDOW,
                "sub_dims": list(SUB_DIMS),
                "batch": 1,
                "contexts": list(contexts),
                "repeats": repeats,
                "quick": args.quick,
                "pq_backends": list(PQ_BACKENDS),
            },
            "results": rows,
            "load_average_1_5_15min": list(os.getloadavg()),  # shared machine: other jobs skew absolute times
            "notes": NOTES,
        },
    )
    plot(rows, name)


if __name__ == "__main__":
    main()
