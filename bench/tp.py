"""Tensor parallelism: prefill and decode step time and per-device memory vs tp.

On CPU the devices are faked (`--xla_force_host_platform_device_count=8`) and share the same
cores, so what shows is the overhead of splitting (collectives, smaller GEMMs), not a speed-up;
per-device parameter and KV-cache bytes show the 1/tp memory split. All tp values are timed
side by side in one run (interleaved repeats, medians).

A second table covers models with fewer kv heads than devices (K = 2 and 4, tp up to 8): past
tp = K every kv head is replicated on the tp / K devices that read it, so the per-device dense and
PQ cache bytes (read from the shards a real prefill leaves on device 0) stop falling at one kv head.

Usage: python -m bench.tp [--quick]   (--quick writes tp_quick.json/png, never the full results)
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

import argparse
import dataclasses
from typing import Any

import jax
import numpy as np

from bench.common import interleaved_times, plot_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.config import ModelConfig
from jaxlongctx.decode_loop import bucket_length
from jaxlongctx.generate import _prefill, generate
from jaxlongctx.kvcache.calibrate import calibrate
from jaxlongctx.model.model import Model
from jaxlongctx.parallel import make_mesh, shard_model
from jaxlongctx.pq_generate import place_codebooks, pq_prefill
from jaxlongctx.sampling import SamplingParams
from jaxlongctx.sharding import cache_sharding, put_batch

FULL = ModelConfig(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=4,
    num_heads=16,
    num_kv_heads=8,
    head_dim=32,
    eos_token_id=2,
)
KV_HEADS = (2, 4)  # kv-head counts of the cache table (fewer than the 8 devices)
QUICK = ModelConfig(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_layers=2,
    num_heads=8,
    num_kv_heads=8,
    head_dim=32,
    eos_token_id=2,
)


def device0_bytes(tree: Any, device: Any) -> int:
    """Bytes of a pytree's shards that live on `device`."""
    return sum(
        s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.device == device
    )


def measure(config: ModelConfig, tps: list[int], prompt: int, new_tokens: int, repeats: int) -> list[dict]:
    """Time prefill (a full forward) and decode (per token) for each tp; report per-device memory."""
    base = Model.init(config, seed=0)
    ids = np.random.default_rng(0).integers(3, config.vocab_size, (1, prompt)).astype(np.int32)
    models = {tp: shard_model(base, make_mesh(tp=tp)) for tp in tps}
    fns: dict[str, Any] = {}
    for tp, model in models.items():
        fns[f"prefill/tp{tp}"] = lambda m=model: m(ids)
        fns[f"generate1/tp{tp}"] = lambda m=model: generate(m, ids, SamplingParams(1))
        fns[f"generate/tp{tp}"] = lambda m=model: generate(m, ids, SamplingParams(new_tokens, stop_ids=()))
    times = interleaved_times(fns, repeats=repeats)
    capacity = bucket_length(bucket_length(prompt) + new_tokens)
    cache_shape = (config.num_layers, 1, config.num_kv_heads, capacity, config.head_dim)  # [L, B, K, S, hd]
    rows = []
    for tp, model in models.items():
        device = model.mesh.devices.flat[0]
        decode = (times[f"generate/tp{tp}"]["median_s"] - times[f"generate1/tp{tp}"]["median_s"]) / (
            new_tokens - 1
        )
        cache_shard = cache_sharding(model.mesh).shard_shape(cache_shape)
        rows.append(
            {
                "tp": tp,
                "prefill_s": times[f"prefill/tp{tp}"]["median_s"],
                "decode_step_s": decode,
                "param_bytes_per_device": device0_bytes(model.params, device),
                "kv_cache_bytes_per_device": 2 * int(np.prod(cache_shard)) * model.dtype.itemsize,
                "times": {k.split("/")[0]: v for k, v in times.items() if k.endswith(f"/tp{tp}")},
            }
        )
    return rows


def cache_bytes_per_device(
    config: ModelConfig, kv_heads: tuple[int, ...], tps: list[int], prompt: int
) -> list[dict]:
    """Per-device bytes of the dense and PQ (ds 2, 4 bits, per-head codebooks, window 16) caches a real
    prefill of `prompt` tokens builds, for each kv-head count and tp (kv heads replicated past tp = K)."""
    rows = []
    ids = np.random.default_rng(1).integers(3, config.vocab_size, (1, prompt)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    for kv in kv_heads:
        base = Model.init(dataclasses.replace(config, num_kv_heads=kv), seed=0)
        stream = np.random.default_rng(2).integers(3, config.vocab_size, 1024)
        codebooks = calibrate(
            base, stream, ds=2, bits=4, granularity="layer_head", iters=2, seq_len=128, max_tokens=1024
        )
        for tp in tps:
            model = shard_model(base, make_mesh(tp=tp)) if tp > 1 else base
            device = jax.devices()[0]
            placed = [put_batch(x, model.mesh) for x in (ids, mask)]
            _, dense = jax.jit(_prefill, static_argnums=(0, 1))(model, prompt, model.params, *placed)
            k_cent, v_cent, _, _ = place_codebooks(codebooks, model.mesh)  # unweighted
            pq = jax.jit(
                lambda p, kc, vc, i, m, mod=model: pq_prefill(mod.merge(p), kc, vc, prompt, 16, False, i, m)
            )(model.params, k_cent, v_cent, *placed)[1]
            rows.append(
                {
                    "kv_heads": kv,
                    "tp": tp,
                    "kv_heads_per_device": dense.k.addressable_shards[0].data.shape[2],
                    "dense_cache_bytes_per_device": device0_bytes((dense.k, dense.v), device),
                    "pq_cache_bytes_per_device": device0_bytes(
                        (pq.k_codes, pq.v_codes, pq.k_window, pq.v_window), device
                    ),
                    "dense_cache_bytes_total": 2 * dense.k.nbytes,
                }
            )
    return rows


def plot(rows: list[dict], cache_rows: list[dict], name: str) -> None:
    """Step times and per-device memory vs tp, relative to tp = 1; cache bytes per device vs tp per kv-head count."""
    tps = [r["tp"] for r in rows]
    fig, (ax_t, ax_m, ax_c) = subplots(1, 3, figsize=(16, 4))
    for key, label in (("prefill_s", "prefill (full forward)"), ("decode_step_s", "decode step")):
        ax_t.plot(tps, [r[key] / rows[0][key] for r in rows], "o-", label=label)
    ax_t.set_xscale("log", base=2)
    ax_t.set(
        xticks=tps,
        xticklabels=tps,
        xlabel="tp (fake CPU devices, shared cores)",
        ylabel="time / time at tp=1",
        title="step time vs tp (overhead on CPU)",
    )
    ax_t.legend()
    for key, label in (("param_bytes_per_device", "parameters"), ("kv_cache_bytes_per_device", "KV cache")):
        ax_m.plot(tps, [r[key] / 2**20 for r in rows], "o-", label=label)
    ax_m.plot(tps, [rows[0]["param_bytes_per_device"] / t / 2**20 for t in tps], "k:", label="params / tp")
    ax_m.set_xscale("log", base=2)
    ax_m.set(
        yscale="log",
        xticks=tps,
        xticklabels=tps,
        xlabel="tp",
        ylabel="MiB per device",
        title="per-device memory vs tp",
    )
    ax_m.legend()
    for kv in sorted({r["kv_heads"] for r in cache_rows}):
        sel = [r for r in cache_rows if r["kv_heads"] == kv]
        for key, style, label in (
            ("dense_cache_bytes_per_device", "o-", "dense"),
            ("pq_cache_bytes_per_device", "s--", "PQ"),
        ):
            ax_c.plot([r["tp"] for r in sel], [r[key] / 2**10 for r in sel], style, label=f"{label}, K={kv}")
    ax_c.set_xscale("log", base=2)
    ax_c.set(
        yscale="log",
        xticks=tps,
        xticklabels=tps,
        xlabel="tp",
        ylabel="KiB per device",
        title="KV cache per device (kv heads replicated past tp = K)",
    )
    ax_c.legend(fontsize=8)
    save_plot(fig, plot_path(name), dpi=100)


def main() -> None:
    """Run the benchmark and write bench/results/tp.json + tp.png."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2-layer model, 128-token prompt, 3 repeats")
    args = parser.parse_args()
    use_quick_results(args.quick)
    config = QUICK if args.quick else FULL
    prompt, new_tokens, repeats = (128, 8, 3) if args.quick else (512, 16, 5)
    tps = [t for t in (1, 2, 4, 8) if t <= len(jax.devices())]
    rows = measure(config, tps, prompt, new_tokens, repeats)
    for r in rows:
        print(
            f"tp={r['tp']}: prefill {r['prefill_s'] * 1e3:.1f} ms, decode step {r['decode_step_s'] * 1e3:.2f} ms, "
            f"params/device {r['param_bytes_per_device'] / 2**20:.2f} MiB, "
            f"KV cache/device {r['kv_cache_bytes_per_device'] / 2**20:.2f} MiB"
        )
    cache_rows = cache_bytes_per_device(config, KV_HEADS, tps, prompt)
    for r in cache_rows:
        print(
            f"K={r['kv_heads']} tp={r['tp']}: {r['kv_heads_per_device']} kv head(s)/device, dense cache/device "
            f"{r['dense_cache_bytes_per_device'] / 2**10:.1f} KiB, PQ cache/device "
            f"{r['pq_cache_bytes_per_device'] / 2**10:.1f} KiB"
        )
    write_result(
        "tp",
        {
            "config": config.to_dict(),
            "prompt_tokens": prompt,
            "new_tokens": new_tokens,
            "repeats": repeats,
            "quick": args.quick,
            "rows": rows,
            "kv_head_cache_rows": cache_rows,
        },
    )
    plot(rows, cache_rows, "tp")


if __name__ == "__main__":
    main()
