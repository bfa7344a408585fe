"""`jaxlongctx demo`: a long prompt through prefill and decode on a small embedded default model."""

from __future__ import annotations

import resource
import time
from typing import Any

import jax
import numpy as np

from jaxlongctx.config import ModelConfig
from jaxlongctx.generate import generate
from jaxlongctx.kvcache.dense import dense_cache_bytes
from jaxlongctx.model.model import Model

# The embedded default: a small GQA Llama (random weights) that fits the demo in seconds on 2 cores.
DEFAULT_CONFIG = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4,
                             num_heads=8, num_kv_heads=2, head_dim=32, rope_theta=500000.0,
                             max_position_embeddings=65536, eos_token_id=2)


def peak_rss_mib() -> float:
    """Peak resident memory of this process in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_demo(model: Model | None = None, *, prompt_tokens: int = 8192, new_tokens: int = 32,
             seed: int = 0, echo: Any = print) -> dict[str, Any]:
    """Prefill a long random prompt and decode greedily; prints and returns the measurements."""
    if model is None:
        echo(f"model: embedded default (random weights) {DEFAULT_CONFIG.num_layers} layers, "
             f"d {DEFAULT_CONFIG.hidden_size}, {DEFAULT_CONFIG.num_heads} heads / "
             f"{DEFAULT_CONFIG.num_kv_heads} kv heads, vocab {DEFAULT_CONFIG.vocab_size}")
        model = Model.init(DEFAULT_CONFIG, seed=seed)
    cfg = model.config
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, cfg.vocab_size, (1, prompt_tokens), dtype=np.int32)
    echo(f"prompt: {prompt_tokens} tokens, generating {new_tokens} greedily on {jax.default_backend()}")

    t0 = time.perf_counter()
    generate(model, ids, 1)  # compiles prefill + decode step, runs the prefill once
    compile_and_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate(model, ids, 1)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = generate(model, ids, new_tokens, eos_id=-1)
    total_s = time.perf_counter() - t0
    decode_s = max(total_s - prefill_s, 1e-9)
    result = {
        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "compile_and_first_call_s": compile_and_first,
        "prefill_tokens_per_s": prompt_tokens / prefill_s,
        "decode_tokens_per_s": (new_tokens - 1) / decode_s,
        "peak_rss_mib": peak_rss_mib(),
        "kv_cache_mib_bf16": dense_cache_bytes(cfg, prompt_tokens + new_tokens) / 2**20,
        "generated_ids": out[0, prompt_tokens:].tolist(),
    }
    echo(f"compile + first call: {compile_and_first:.2f} s")
    echo(f"prefill: {result['prefill_tokens_per_s']:,.0f} tokens/s ({prefill_s:.2f} s)")
    echo(f"decode:  {result['decode_tokens_per_s']:,.1f} tokens/s")
    echo(f"peak memory (RSS): {result['peak_rss_mib']:,.0f} MiB; "
         f"dense KV cache at this length (bf16): {result['kv_cache_mib_bf16']:.1f} MiB")
    echo(f"generated ids: {result['generated_ids']}")
    return result
