"""Time per output token, dense bf16/fp32 cache vs PQ cache (ds 2 and 4; 8-bit codes, and with `--bits 8,4`
4-bit codes two a byte), plus cache bytes vs context.

Decode steps are the ones `generate` runs (jitted, cache donated), timed side by side in one run
(interleaved, median of repeats) over a cache already holding `context` tokens; the PQ window
flush (one batch every R tokens) is timed separately and amortized over R tokens. CPU: the
shipped model's shape, fp32, 1K..32K (--quick: 1K..8K). GPU: Llama-2-7B shapes in bf16, 1K..32K.

    python -m bench.pq_decode [--quick]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.common import interleaved_times, plot_path, save_plot, subplots, use_quick_results, write_result
from jaxlongctx.config import ModelConfig
from jaxlongctx.demo import BASE_MODEL

LLAMA2_7B = ModelConfig(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
)
LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
)
SMALL = ModelConfig(
    vocab_size=4096,
    hidden_size=192,
    intermediate_size=512,
    num_layers=4,
    num_heads=6,
    num_kv_heads=2,
    head_dim=32,
)  # the shipped model's shape, if its files are absent


def _our_config() -> ModelConfig:
    """The shipped base model's config (weights are not needed for timing)."""
    import json

    path = BASE_MODEL / "config.json"
    return ModelConfig.from_dict(json.loads(path.read_text())["config"]) if path.is_file() else SMALL


def cache_name(ds: int, bits: int) -> str:
    """The timing rows' name of a PQ cache: pq_ds2 (8-bit codes), pq_ds2_4bit, ..."""
    return f"pq_ds{ds}" + ("" if bits == 8 else f"_{bits}bit")


def _random_codebooks(cfg: ModelConfig, ds: int, bits: int = 8):
    """Shared codebooks with random centroids (timing does not depend on their values)."""
    from jaxlongctx.kvcache import Codebooks, centroid_shape

    shape = centroid_shape("shared", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, ds, bits)
    kk, kv = jax.random.split(jax.random.key(0))
    return Codebooks(
        jax.random.normal(kk, shape),
        jax.random.normal(kv, shape),
        "shared",
        ds,
        bits,
        cfg.head_dim,
        cfg.num_layers,
        cfg.num_kv_heads,
    )


def random_codes(codebooks, tokens_shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Synthetic K and V codes `[*tokens_shape, M]` uint8 for `codebooks` (decode time does not depend on
    their values), `[*tokens_shape, M/2]` where codes are packed two a byte (then any byte is valid)."""
    from pallas_kernels.pq_codes import code_bytes, packs

    centroids, subspaces = codebooks.num_centroids, codebooks.num_subspaces
    packed = packs(centroids, subspaces)
    shape = (*tokens_shape, code_bytes(centroids, subspaces))
    k_codes = jax.random.randint(jax.random.key(2), shape, 0, 256 if packed else centroids).astype(jnp.uint8)
    v_codes = k_codes ^ 0x11 if packed else (k_codes + 1) % centroids  # other codes, still valid
    return k_codes, v_codes.astype(jnp.uint8)


class _Chain:
    """A decode loop whose state (cache, logits, position) carries over between timed calls."""

    def __init__(self, step, state):
        self.step, self.state = step, state

    def __call__(self, n: int):
        for _ in range(n):
            self.state = self.step(self.state)
        return self.state


def _dense_chain(model, context: int, total_steps: int, batch: int):
    """Dense decode positioned after `context` cached tokens."""
    from jaxlongctx.generate import _compiled
    from jaxlongctx.kvcache.dense import DenseCache

    cfg = model.config
    capacity = context + total_steps
    _, step = _compiled(model, capacity, (0.0, None, None), (), 0)
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)  # DenseCache [L B K S hd]
    k = jax.random.normal(jax.random.key(1), shape, model.dtype)
    cache = DenseCache(k, k * 0.5, jnp.arange(capacity)[None].repeat(batch, 0) < context)
    logits = jnp.zeros((batch, cfg.vocab_size), jnp.float32)
    done, key = jnp.zeros((batch,), bool), jax.random.key(0)

    def advance(state):
        cache, logits, i = state
        _, _, logits, cache = step(
            model.params, cache, logits, key, done, jnp.full((batch,), context + i), jnp.int32(context + i)
        )
        return cache, logits, i + 1

    return _Chain(advance, (cache, logits, 0))


def _pq_chain(model, codebooks, context: int, total_steps: int, window: int, batch: int):
    """PQ decode positioned after `context` cached tokens (context - R/2 coded, R/2 exact)."""
    from jaxlongctx.kvcache.pq_cache import PQCache
    from jaxlongctx.pq_generate import _compiled

    cfg = model.config
    exact = window // 2
    capacity = context + total_steps + window
    _, step = _compiled(model, capacity, (window, False, 0, 0), (0.0, None, None), (), 0, "auto")
    k_cent, v_cent = codebooks.stacked()
    k_codes, v_codes = random_codes(codebooks, (cfg.num_layers, batch, cfg.num_kv_heads, capacity))
    win = jax.random.normal(
        jax.random.key(3), (cfg.num_layers, batch, cfg.num_kv_heads, window, cfg.head_dim), model.dtype
    )
    cache = PQCache(
        k_codes,
        v_codes,
        win,
        win * 0.5,
        jnp.full((batch,), context - exact, jnp.int32),
        jnp.full((batch,), exact, jnp.int32),
    )
    logits = jnp.zeros((batch, cfg.vocab_size), jnp.float32)
    done, key = jnp.zeros((batch,), bool), jax.random.key(0)

    def advance(state):
        cache, logits, i = state
        _, _, logits, cache = step(
            model.params,
            (k_cent, v_cent, None, None),
            cache,
            logits,
            key,
            done,
            jnp.full((batch,), context + i),
        )
        return cache, logits, i + 1

    return _Chain(advance, (cache, logits, 0))


def _flush_seconds(model, codebooks, window: int, batch: int, repeats: int) -> float:
    """Median seconds of one window flush (encode R tokens of every layer and head, append)."""
    from jaxlongctx.kvcache.pq_cache import PQCache, flush_full_rows
    from pallas_kernels.pq_codes import code_bytes

    cfg = model.config
    k_cent, v_cent = codebooks.stacked()
    width = code_bytes(codebooks.num_centroids, codebooks.num_subspaces)  # M, or M/2 packed
    codes = jnp.zeros((cfg.num_layers, batch, cfg.num_kv_heads, 2 * window, width), jnp.uint8)
    win = jax.random.normal(
        jax.random.key(4), (cfg.num_layers, batch, cfg.num_kv_heads, window, cfg.head_dim), model.dtype
    )
    cache = PQCache(
        codes, codes, win, win, jnp.zeros((batch,), jnp.int32), jnp.full((batch,), window, jnp.int32)
    )
    flush = jax.jit(flush_full_rows)
    return interleaved_times({"flush": lambda: flush(cache, k_cent, v_cent)}, repeats=repeats)["flush"][
        "median_s"
    ]


def cache_bytes_table(contexts: list[int], window: int = 128) -> list[dict]:
    """Exact PQ cache bytes (codes + bf16 window + codebooks) vs dense bf16 for three model shapes."""
    from jaxlongctx.kvcache import cache_bytes

    rows = []
    for name, cfg in (("ours", _our_config()), ("llama2-7b", LLAMA2_7B), ("llama3-8b", LLAMA3_8B)):
        for ds in (2, 4):
            for n in contexts:
                r = cache_bytes(n, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, ds, 8, window)
                rows.append({"model": name, "ds": ds, "bits": 8, "context": n, **r})
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Run the timing and bytes tables; write bench/results/pq_decode.json + .png."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="contexts 1K..8K")
    p.add_argument("--steps", type=int, default=8, help="decode steps per timed call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--contexts",
        type=lambda v: [int(c) for c in v.split(",")],
        help="comma-separated context lengths instead of 1K..32K (bench/device_run.py: 32768)",
    )
    p.add_argument(
        "--ds",
        type=lambda v: [int(d) for d in v.split(",")],
        default=[2, 4],
        help="comma-separated PQ sub-vector sizes (default 2,4)",
    )
    p.add_argument(
        "--bits",
        type=lambda v: [int(b) for b in v.split(",")],
        default=[8],
        help="comma-separated code bits (default 8; 4: 16 centroids, codes two a byte)",
    )
    args = p.parse_args(argv)
    use_quick_results(args.quick)

    from jaxlongctx.model.model import Model
    from pallas_kernels.pq_attention_cpu import native_kernel_error

    gpu = jax.default_backend() == "gpu"
    cfg, dtype = (LLAMA2_7B, jnp.bfloat16) if gpu else (_our_config(), jnp.float32)
    contexts = args.contexts or [1024, 2048, 4096, 8192] + ([] if args.quick else [16384, 32768])
    model = Model.init(cfg, dtype=dtype)
    books = {cache_name(ds, bits): _random_codebooks(cfg, ds, bits) for ds in args.ds for bits in args.bits}
    total = args.steps * (args.repeats + 1)
    timing = []
    for n in contexts:
        fns = {"dense": _dense_chain(model, n, total, args.batch)}
        for name, cb in books.items():
            fns[name] = _pq_chain(model, cb, n, total, args.window, args.batch)
        times = interleaved_times(
            {k: (lambda f=f: f(args.steps)) for k, f in fns.items()}, repeats=args.repeats
        )
        row = {"context": n, **{f"{k}_s_per_token": v["median_s"] / args.steps for k, v in times.items()}}
        for name in books:
            row[f"dense_over_{name}"] = row["dense_s_per_token"] / row[f"{name}_s_per_token"]
        timing.append(row)
        print(row, flush=True)
        del fns
    flush = {
        f"{name}_flush_s": _flush_seconds(model, cb, args.window, args.batch, args.repeats)
        for name, cb in books.items()
    }
    for row in timing:  # amortize one flush per R tokens
        for name in books:
            amortized = row[f"{name}_s_per_token"] + flush[f"{name}_flush_s"] / args.window
            row[f"{name}_amortized_s_per_token"] = amortized
            row[f"dense_over_{name}_amortized"] = row["dense_s_per_token"] / amortized
    payload = {
        "config": {
            "model_config": cfg.to_dict(),
            "dtype": jnp.dtype(dtype).name,
            "batch": args.batch,
            "window": args.window,
            "steps_per_call": args.steps,
            "repeats": args.repeats,
            "contexts": contexts,
            "pq_caches": {name: {"ds": cb.ds, "bits": cb.bits} for name, cb in books.items()},
            "codebooks": "shared, random centroids; codes of at most 4 bits stored two a byte",
            "quick": args.quick,
            "pq_backend": "pallas" if gpu else ("native" if native_kernel_error() is None else "xla"),
        },
        "timing": timing,
        "flush": flush,
        "cache_bytes": cache_bytes_table([1024, 2048, 4096, 8192, 16384, 32768], args.window),
    }
    write_result("pq_decode", payload)
    _plot(payload, plot_path("pq_decode"))
    return payload


def _plot(payload: dict, path: Path) -> None:
    """Left: time per output token vs context; right: cache compression vs context."""
    fig, (a, b) = subplots(1, 2, figsize=(11, 4))
    ctx = [r["context"] for r in payload["timing"]]
    a.plot(ctx, [1e3 * r["dense_s_per_token"] for r in payload["timing"]], "o-", label="dense")
    for name in payload["config"]["pq_caches"]:
        a.plot(
            ctx,
            [1e3 * r[f"{name}_amortized_s_per_token"] for r in payload["timing"]],
            "o-",
            label=f"{name.replace('_', ' ')} (flush amortized)",
        )
    a.set(
        xscale="log",
        xlabel="context (tokens)",
        ylabel="ms per output token",
        title=f"decode, batch {payload['config']['batch']}, {payload['config']['dtype']}",
    )
    a.legend()
    for name, style in (("ours", "-"), ("llama2-7b", "--"), ("llama3-8b", ":")):
        for ds in (2, 4):
            rows = [r for r in payload["cache_bytes"] if r["model"] == name and r["ds"] == ds]
            b.plot(
                [r["context"] for r in rows],
                [r["compression"] for r in rows],
                style,
                marker="o",
                ms=3,
                label=f"{name} ds{ds}",
            )
    b.axhline(4, color="gray", lw=0.5)
    b.axhline(8, color="gray", lw=0.5)
    b.set(
        xscale="log",
        xlabel="context (tokens)",
        ylabel="dense bf16 bytes / PQ bytes",
        title="KV cache compression vs dense bf16 (R=128)",
    )
    b.legend(fontsize=7)
    save_plot(fig, path, dpi=120)


if __name__ == "__main__":
    main()
