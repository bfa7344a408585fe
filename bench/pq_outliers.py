"""Attention error of PQ (MILLION) vs uniform (KIVI-style) KV quantization as outliers grow.

Synthetic post-RoPE keys/values (Gaussian, head dim 128) get either outlier CHANNELS (a few
key channels scaled by a factor) or outlier TOKENS (a few tokens' keys and values scaled by
a factor). For each factor, PQ codebooks (8-bit, ds 2 and ds 4, shared over subspaces as in
the reference) are trained on separate calibration draws from the same distribution, then
the attention output of a handful of queries over quantized K/V is compared with exact
attention. Baselines at about equal bits: int4 vs ds 2 (4 bits/elt), int2 vs ds 4 (2 bits/elt);
KIVI's fp16 scale + zero per group add 1 bit/elt at group 32 (0.25 at group 128).

Usage: python -m bench.pq_outliers [--quick]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import plot_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.kvcache import (
    effective_bits,
    fake_quantize,
    fake_quantize_keys,
    fake_quantize_values,
    train_codebooks,
)

D = 128
OUTLIER_CHANNELS = 4
OUTLIER_TOKEN_FRACTION = 0.01
SCENARIOS = ("channel", "token")


def draw_kv(
    key: jax.Array, tokens: int, scenario: str, factor: float, channels: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Gaussian K/V [T, D] with outlier channels (keys only) or outlier tokens (keys and values)."""
    kk, kv, kt = jax.random.split(key, 3)
    keys = jax.random.normal(kk, (tokens, D))
    values = jax.random.normal(kv, (tokens, D))
    if scenario == "channel":
        return keys.at[:, channels].multiply(factor), values
    n_out = max(1, round(OUTLIER_TOKEN_FRACTION * tokens))
    rows = jax.random.choice(kt, tokens, (n_out,), replace=False)
    return keys.at[rows].multiply(factor), values.at[rows].multiply(factor)


def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Exact float32 softmax attention: q[Q, D], k/v[T, D] -> [Q, D]."""
    scores = jnp.einsum("qd,td->qt", q, k, precision=jax.lax.Precision.HIGHEST) / np.sqrt(D)
    return jnp.einsum("qt,td->qd", jax.nn.softmax(scores, axis=-1), v, precision=jax.lax.Precision.HIGHEST)


def rel_err(a: jax.Array, b: jax.Array, axis: int | None = None) -> np.ndarray:
    """||a - b|| / ||b|| (over `axis`, or the whole array)."""
    return np.asarray(jnp.linalg.norm(a - b, axis=axis) / jnp.linalg.norm(b, axis=axis))


def run(quick: bool, seed: int) -> dict[str, Any]:
    """Sweep scenarios x outlier factors x methods; returns the result payload."""
    cfg = {
        "head_dim": D,
        "tokens": 2048 if quick else 4096,
        "calibration_tokens": 8192 if quick else 32768,
        "queries": 32 if quick else 64,
        "factors": [1, 10, 100] if quick else [1, 2, 5, 10, 20, 50, 100],
        "kmeans_iters": 15 if quick else 25,
        "outlier_channels": OUTLIER_CHANNELS,
        "outlier_token_fraction": OUTLIER_TOKEN_FRACTION,
        "pq_bits": 8,
        "pq_granularity": "shared",
        "seed": seed,
    }
    methods = {
        "pq_ds2": {"bits_per_element": 8 / 2},
        "int4_g32": {"bits_per_element": effective_bits(4, 32)},
        "int4_g128": {"bits_per_element": effective_bits(4, 128)},
        "pq_ds4": {"bits_per_element": 8 / 4},
        "int2_g32": {"bits_per_element": effective_bits(2, 32)},
        "int2_g128": {"bits_per_element": effective_bits(2, 128)},
    }
    root = jax.random.key(seed)
    channels = jax.random.choice(jax.random.fold_in(root, 0), D, (OUTLIER_CHANNELS,), replace=False)
    cfg["outlier_channel_ids"] = [int(c) for c in channels]
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    for si, scenario in enumerate(SCENARIOS):
        per_method: dict[str, dict[str, list[float]]] = {
            m: {"attn_rel_err": [], "attn_rel_err_max": [], "key_rel_err": [], "value_rel_err": []}
            for m in methods
        }
        for fi, factor in enumerate(cfg["factors"]):
            k_eval, k_cal, k_q, k_train = jax.random.split(jax.random.fold_in(root, 100 * si + fi + 1), 4)
            keys, values = draw_kv(k_eval, cfg["tokens"], scenario, factor, channels)
            cal_k, cal_v = draw_kv(k_cal, cfg["calibration_tokens"], scenario, factor, channels)
            queries = jax.random.normal(k_q, (cfg["queries"], D))
            exact = attention(queries, keys, values)
            approx: dict[str, tuple[jax.Array, jax.Array]] = {}
            for ds in (2, 4):
                cb = train_codebooks(
                    cal_k[None, :, None],
                    cal_v[None, :, None],
                    ds,
                    8,
                    "shared",
                    cfg["kmeans_iters"],
                    key=k_train,
                    progress=False,
                )
                k_cent, v_cent = cb.for_layer(0)
                approx[f"pq_ds{ds}"] = (fake_quantize(keys, k_cent), fake_quantize(values, v_cent))
            for bits in (4, 2):
                for group in (32, 128):
                    approx[f"int{bits}_g{group}"] = (
                        fake_quantize_keys(keys, bits, group),
                        fake_quantize_values(values, bits, group),
                    )
            for name, (k_hat, v_hat) in approx.items():
                per_query = rel_err(attention(queries, k_hat, v_hat), exact, axis=-1)
                per_method[name]["attn_rel_err"].append(float(per_query.mean()))
                per_method[name]["attn_rel_err_max"].append(float(per_query.max()))
                per_method[name]["key_rel_err"].append(float(rel_err(k_hat, keys)))
                per_method[name]["value_rel_err"].append(float(rel_err(v_hat, values)))
            line = "  ".join(f"{n}={per_method[n]['attn_rel_err'][-1]:.4f}" for n in methods)
            print(f"{scenario:8s} factor {factor:>4}: {line}", flush=True)
        results[scenario] = per_method
    return {"config": cfg, "methods": methods, "results": results}


def plot(payload: dict[str, Any], name: str) -> None:
    """Two panels (channel / token outliers): attention relative error vs outlier factor."""
    styles = {
        "pq_ds2": ("tab:blue", "-", "o"),
        "int4_g32": ("tab:orange", "-", "s"),
        "int4_g128": ("tab:orange", ":", "s"),
        "pq_ds4": ("tab:green", "-", "o"),
        "int2_g32": ("tab:red", "-", "s"),
        "int2_g128": ("tab:red", ":", "s"),
    }
    factors = payload["config"]["factors"]
    fig, axes = subplots(1, 2, figsize=(13, 4.2), sharey=True)
    for ax, scenario in zip(axes, SCENARIOS):
        for method, (color, ls, marker) in styles.items():
            bpe = payload["methods"][method]["bits_per_element"]
            ax.plot(
                factors,
                payload["results"][scenario][method]["attn_rel_err"],
                color=color,
                ls=ls,
                marker=marker,
                label=f"{method} ({bpe:g} b/elt)",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("outlier factor")
        ax.set_title(f"outlier {scenario}s")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("attention output relative error")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="center right", fontsize=8)
    fig.suptitle(f"PQ vs uniform KV quantization, D={D}, T={payload['config']['tokens']}")
    save_plot(fig, plot_path(name), dpi=120, rect=(0, 0, 0.86, 1))


def main() -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small sizes (a couple of minutes on 2 CPU cores)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    use_quick_results(args.quick)
    t0 = time.perf_counter()
    payload = run(args.quick, args.seed)
    payload["wall_s"] = time.perf_counter() - t0
    write_result("pq_outliers", payload)
    plot(payload, "pq_outliers")


if __name__ == "__main__":
    main()
