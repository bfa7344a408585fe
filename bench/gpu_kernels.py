"""GPU benchmark of the Pallas kernels: correctness on the device, then timings against XLA baselines.

1. Correctness: grouped GEMM (forward and VJP) and PQ decode attention, Pallas vs the plain-jnp oracles.
2. Grouped GEMM for one ARMT diagonal step of Llama-3.2-1B (L 16, T 1152, d 2048, MLP 8192, bf16),
   num_active 1..16: Pallas kernel vs batched einsum (the XLA reference) vs `jax.lax.ragged_dot`.
3. PQ decode attention (Llama-3-8B heads: 32 q, 8 kv, D 128; ds 2 and 4) vs exact bf16 decode
   attention (`jax.nn.dot_product_attention`) at 1K..128K context (--quick: 1K..32K), batch 1.

Without a GPU it exits with a message (code 0). `--dry-run-cpu` runs every code path on CPU with tiny
shapes and the Pallas interpreter (backend "interpret") and writes `gpu_kernels_dry_run_cpu.json`.

Usage: python -m bench.gpu_kernels [--quick] [--dry-run-cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import interleaved_times, plot_path, save_plot, subplots, use_quick_results, write_result
from pallas_kernels import grouped_matmul, pq_decode_attention
from pallas_kernels.grouped_matmul import grouped_matmul_reference
from pallas_kernels.pq_attention_reference import pq_decode_attention_reference

CENTROIDS = 256
SUB_DIMS = (2, 4)


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of one benchmark run."""

    backend: str  # kernel backend for the Pallas side: "pallas" on GPU, "interpret" for the CPU dry run
    layers: int  # L (also G, the row groups of a diagonal step)
    tokens: int  # T rows per group
    model_dim: int  # d
    mlp_dim: int
    num_active: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    window: int  # R exact tokens
    contexts: tuple[int, ...]
    pq_check_groups: tuple[int, ...]  # GQA group sizes the PQ correctness check covers
    repeats: int


def gpu_config(quick: bool) -> Config:
    """Llama-3.2-1B diagonal step and Llama-3-8B attention heads."""
    return Config(
        "pallas",
        16,
        1152,
        2048,
        8192,
        (1, 8, 16) if quick else (1, 2, 4, 8, 12, 16),
        32,
        8,
        128,
        128,
        (1024, 4096, 16384, 32768) if quick else (1024, 4096, 16384, 32768, 65536, 131072),
        (1, 4, 8),
        5 if quick else 10,
    )


def dry_run_config() -> Config:
    """Tiny shapes that run every code path through the Pallas interpreter on CPU (d = MLP width, so
    that the up and down projections share their compiled functions)."""
    return Config("interpret", 4, 8, 32, 32, (1, 4), 4, 2, 64, 16, (64,), (4,), 2)


# ---------------------------------------------------------------- inputs


def gemm_inputs(
    rng: np.random.Generator, groups: int, tokens: int, depth: int, width: int, layers: int, dtype
) -> tuple[jax.Array, jax.Array]:
    """x [G T K] and w [L K N] with unit-scale outputs."""
    x = jnp.asarray(rng.standard_normal((groups, tokens, depth)), jnp.float32).astype(dtype)
    w = jnp.asarray(rng.standard_normal((layers, depth, width)) / np.sqrt(depth), jnp.float32).astype(dtype)
    return x, w


def pq_inputs(
    rng: np.random.Generator,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    sub_dim: int,
    capacity: int,
    lengths: tuple[int, ...],
    window: int,
    res_lengths: tuple[int, ...],
    per_head: bool,
    dtype=jnp.bfloat16,
) -> tuple[jax.Array, ...]:
    """Positional arguments of pq_decode_attention (without scale) for a random coded cache."""
    subspaces = head_dim // sub_dim
    cent_shape = (kv_heads, subspaces, CENTROIDS, sub_dim) if per_head else (subspaces, CENTROIDS, sub_dim)
    arr = lambda shape, dt: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dt)
    codes = lambda: jnp.asarray(rng.integers(0, CENTROIDS, (batch, kv_heads, capacity, subspaces)), jnp.uint8)
    return (
        arr((batch, heads, head_dim), dtype),
        codes(),
        codes(),
        arr(cent_shape, jnp.float32),
        arr(cent_shape, jnp.float32),
        jnp.asarray(lengths, jnp.int32),
        arr((batch, kv_heads, window, head_dim), dtype),
        arr((batch, kv_heads, window, head_dim), dtype),
        jnp.asarray(res_lengths, jnp.int32),
    )


def ragged_grouped_matmul(x: jax.Array, w: jax.Array, first_layer, num_active) -> jax.Array:
    """The same diagonal-step GEMM through jax.lax.ragged_dot: active rows map to layers in order."""
    groups, tokens, depth = x.shape
    layers = jnp.arange(w.shape[0])
    sizes = jnp.where((layers >= first_layer) & (layers < first_layer + num_active), tokens, 0)  # [L]
    y = jax.lax.ragged_dot(
        x.reshape(groups * tokens, depth), w, sizes.astype(jnp.int32)
    )  # rows past sum -> 0
    return y.reshape(groups, tokens, w.shape[2])


# ---------------------------------------------------------------- correctness


def _max_err(got: jax.Array, want: jax.Array) -> float:
    """Max abs error relative to the largest reference magnitude."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def check_gemm(cfg: Config, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Forward, VJP and ragged_dot vs the reference on ragged shapes, fp32 and bf16."""
    groups = cfg.layers
    tokens, depth, width = (
        cfg.tokens + 3,
        cfg.model_dim + 5,
        cfg.mlp_dim // 2 + 7,
    )  # not multiples of any block
    rows = []
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)):
        x, w = gemm_inputs(rng, groups, tokens, depth, width, groups, dtype)
        fwd = jax.jit(lambda x, w, f, n: grouped_matmul(x, w, f, n, backend=cfg.backend))
        loss = lambda x, w, b: jnp.sum(
            grouped_matmul(x, w, 1, groups - 2, backend=b).astype(jnp.float32) ** 2
        )
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
        for first, active in ((0, groups), (0, 1), (1, groups - 2)):
            want = grouped_matmul_reference(x, w, first, active)
            for name, got in (
                ("pallas", fwd(x, w, jnp.int32(first), jnp.int32(active))),
                ("ragged_dot", ragged_grouped_matmul(x, w, first, active)),
            ):
                err = _max_err(got, want)
                rows.append(
                    {
                        "kernel": "grouped_matmul",
                        "method": name,
                        "dtype": jnp.dtype(dtype).name,
                        "first_layer": first,
                        "num_active": active,
                        "rel_err": err,
                        "ok": err <= tol,
                    }
                )
        for part, got, want in zip(("dx", "dw"), grad(x, w, cfg.backend), grad(x, w, "xla")):
            err = _max_err(got, want)
            rows.append(
                {
                    "kernel": "grouped_matmul_vjp",
                    "method": part,
                    "dtype": jnp.dtype(dtype).name,
                    "rel_err": err,
                    "ok": err <= 4 * tol,
                }
            )
    return rows


def check_pq(cfg: Config, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Pallas PQ attention vs the dequantize-then-attend oracle over ds, GQA group, codebook sharing."""
    capacity = min(cfg.contexts[-1], 16384)
    rows = []
    for sub_dim in SUB_DIMS:
        for group in cfg.pq_check_groups:
            for per_head in (False, True):
                args = pq_inputs(
                    rng,
                    batch=3,
                    heads=cfg.kv_heads * group,
                    kv_heads=cfg.kv_heads,
                    head_dim=cfg.head_dim,
                    sub_dim=sub_dim,
                    capacity=capacity,
                    lengths=(capacity, 0, capacity // 3 + 1),
                    window=cfg.window,
                    res_lengths=(cfg.window, 1, 0),
                    per_head=per_head,
                    dtype=jnp.float32,
                )
                scale = cfg.head_dim**-0.5
                got = jax.jit(lambda *a: pq_decode_attention(*a, scale, backend=cfg.backend))(*args)
                err = _max_err(got, pq_decode_attention_reference(*args, scale))
                rows.append(
                    {
                        "kernel": "pq_decode_attention",
                        "sub_dim": sub_dim,
                        "group": group,
                        "per_head_codebooks": per_head,
                        "rel_err": err,
                        "ok": err <= 1e-4 and bool(np.all(np.isfinite(np.asarray(got)))),
                    }
                )
    return rows


# ---------------------------------------------------------------- timing


def time_gemm(cfg: Config, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Pallas grouped GEMM vs batched einsum vs ragged_dot (forward), plus forward+backward of the first two."""
    methods: dict[str, Callable] = {
        "pallas": jax.jit(lambda x, w, n: grouped_matmul(x, w, 0, n, backend=cfg.backend)),
        "einsum": jax.jit(lambda x, w, n: grouped_matmul(x, w, 0, n, backend="xla")),
        "ragged_dot": jax.jit(lambda x, w, n: ragged_grouped_matmul(x, w, 0, n)),
    }
    for name in ("pallas", "einsum"):
        backend = cfg.backend if name == "pallas" else "xla"
        loss = lambda x, w, n, b=backend: jnp.sum(grouped_matmul(x, w, 0, n, backend=b).astype(jnp.float32))
        methods[f"{name}_fwd_bwd"] = jax.jit(jax.grad(loss, argnums=(0, 1)))
    rows = []
    for proj, depth, width in (
        ("mlp_up", cfg.model_dim, cfg.mlp_dim),
        ("mlp_down", cfg.mlp_dim, cfg.model_dim),
    ):
        x, w = gemm_inputs(rng, cfg.layers, cfg.tokens, depth, width, cfg.layers, jnp.bfloat16)
        for active in cfg.num_active:
            n = jnp.int32(active)
            times = interleaved_times(
                {m: (lambda f=f: f(x, w, n)) for m, f in methods.items()}, repeats=cfg.repeats
            )
            flops = 2 * active * cfg.tokens * depth * width
            row = {
                "projection": proj,
                "num_active": active,
                "G": cfg.layers,
                "T": cfg.tokens,
                "K": depth,
                "N": width,
                "times": times,
                "active_tflops": {
                    m: flops / t["median_s"] / 1e12 for m, t in times.items() if not m.endswith("fwd_bwd")
                },
                "time_over_pallas": {
                    m: times[m]["median_s"] / times["pallas"]["median_s"] for m in ("einsum", "ragged_dot")
                },
                "fwd_bwd_einsum_over_pallas": times["einsum_fwd_bwd"]["median_s"]
                / times["pallas_fwd_bwd"]["median_s"],
            }
            rows.append(row)
            print(
                f"gemm {proj} active {active:2d}: "
                + ", ".join(f"{m} {t['median_s'] * 1e3:.3f}ms" for m, t in times.items()),
                flush=True,
            )
    return rows


def time_pq(cfg: Config, rng: np.random.Generator) -> list[dict[str, Any]]:
    """PQ decode attention (Pallas and XLA paths) vs exact bf16 decode attention per context length."""
    scale = cfg.head_dim**-0.5
    pq = {b: jax.jit(lambda *a, b=b: pq_decode_attention(*a, scale, backend=b)) for b in (cfg.backend, "xla")}
    exact = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale))
    rows = []
    for context in cfg.contexts:
        coded = context - cfg.window
        fns: dict[str, Callable] = {}
        for sub_dim in SUB_DIMS:
            args = pq_inputs(
                rng,
                batch=1,
                heads=cfg.heads,
                kv_heads=cfg.kv_heads,
                head_dim=cfg.head_dim,
                sub_dim=sub_dim,
                capacity=coded,
                lengths=(coded,),
                window=cfg.window,
                res_lengths=(cfg.window,),
                per_head=False,
            )
            fns[f"pq_pallas_ds{sub_dim}"] = lambda a=args: pq[cfg.backend](*a)
            fns[f"pq_xla_ds{sub_dim}"] = lambda a=args: pq["xla"](*a)
        kv_shape = (1, context, cfg.kv_heads, cfg.head_dim)  # [B N K D]
        k = jnp.asarray(rng.standard_normal(kv_shape), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal(kv_shape), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((1, 1, cfg.heads, cfg.head_dim)), jnp.bfloat16)
        fns["exact_bf16"] = lambda: exact(q, k, v)
        times = interleaved_times(fns, repeats=cfg.repeats)
        exact_s = times["exact_bf16"]["median_s"]
        rows.append(
            {
                "context": context,
                "times": times,
                "exact_bf16_over_pq": {
                    m: exact_s / t["median_s"] for m, t in times.items() if m != "exact_bf16"
                },
                "exact_bytes": 2 * context * cfg.kv_heads * cfg.head_dim * 2,
                "pq_code_bytes": {f"ds{d}": 2 * coded * cfg.kv_heads * cfg.head_dim // d for d in SUB_DIMS},
            }
        )
        print(
            f"pq context {context:6d}: "
            + ", ".join(f"{m} {t['median_s'] * 1e3:.3f}ms" for m, t in times.items()),
            flush=True,
        )
    return rows


def plot(gemm_rows: list[dict[str, Any]], pq_rows: list[dict[str, Any]], name: str) -> None:
    """Left: grouped-GEMM time per num_active (up projection); right: PQ vs exact time per context."""
    fig, (ax_g, ax_p) = subplots(1, 2, figsize=(12, 4))
    up = [r for r in gemm_rows if r["projection"] == "mlp_up"]
    for m in ("pallas", "einsum", "ragged_dot"):
        ax_g.plot(
            [r["num_active"] for r in up], [r["times"][m]["median_s"] * 1e3 for r in up], marker="o", label=m
        )
    ax_g.set_xlabel("num_active (diagonal step)")
    ax_g.set_ylabel("median ms (MLP up projection)")
    for m in pq_rows[0]["times"]:
        ax_p.plot(
            [r["context"] for r in pq_rows],
            [r["times"][m]["median_s"] * 1e3 for r in pq_rows],
            marker="o",
            label=m,
        )
    ax_p.set_xscale("log", base=2)
    ax_p.set_yscale("log")
    ax_p.set_xlabel("context tokens")
    ax_p.set_ylabel("median ms per decode step")
    for ax in (ax_g, ax_p):
        ax.grid(True, alpha=0.3)
        ax.legend()
    save_plot(fig, plot_path(name), dpi=120)


def main() -> int:
    """Run correctness then timings; returns the process exit code (1 if any correctness check fails)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer num_active values and contexts")
    parser.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="tiny shapes through the Pallas interpreter on CPU (checks the script, not the GPU)",
    )
    args = parser.parse_args()
    use_quick_results(args.quick)
    if args.dry_run_cpu:
        cfg, name = dry_run_config(), "gpu_kernels_dry_run_cpu"
    elif jax.default_backend() != "gpu":
        print(
            f"bench.gpu_kernels: no GPU (jax backend is {jax.default_backend()!r}); nothing to measure. "
            "Use --dry-run-cpu to exercise the script on CPU."
        )
        return 0
    else:
        cfg, name = gpu_config(args.quick), "gpu_kernels"
    rng = np.random.default_rng(0)
    checks = check_gemm(cfg, rng) + check_pq(cfg, rng)
    failed = [c for c in checks if not c["ok"]]
    print(
        f"correctness: {len(checks) - len(failed)}/{len(checks)} ok"
        + "".join(f"\n  FAIL {c}" for c in failed)
    )
    # saved after each part, so that a time-boxed run (bench/device_run.py) keeps what it measured
    payload = {"config": dataclasses.asdict(cfg), "correctness": checks, "complete": False}
    write_result(name, payload)
    payload["grouped_matmul"] = time_gemm(cfg, rng)
    write_result(name, payload)
    payload.update(pq_decode_attention=time_pq(cfg, rng), complete=True)
    write_result(name, payload)
    plot(payload["grouped_matmul"], payload["pq_decode_attention"], name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
