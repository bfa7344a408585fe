"""Codebook calibration: run the model over calibration text, collect post-RoPE K/V, train PQ codebooks
(the `jaxlongctx calibrate` command is `jaxlongctx.commands.calibrate`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxlongctx.kvcache.channel_weights import (
    WEIGHTINGS,
    Weighting,
    attention_weights,
    query_second_moments,
)
from jaxlongctx.kvcache.codebooks import (
    GRANULARITIES,
    Codebooks,
    Granularity,
    train_codebooks,
)
from jaxlongctx.kvcache.model_codebooks import model_fingerprint
from jaxlongctx.model.llama import forward_hidden
from jaxlongctx.model.model import Model


def collect_kv(
    model: Model,
    tokens: np.ndarray,
    seq_len: int,
    max_tokens: int,
    batch_size: int = 4,
    progress: bool = False,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Post-RoPE keys and values `[L, N, K, D]` (float32) over non-overlapping windows of `seq_len` tokens."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if seq_len < 1 or max_tokens < seq_len:
        raise ValueError(f"need 1 <= seq_len <= max_tokens, got seq_len={seq_len}, max_tokens={max_tokens}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= model.config.vocab_size):
        raise ValueError(
            f"calibration token ids must be in [0, {model.config.vocab_size}), got "
            f"[{tokens.min()}, {tokens.max()}] (tokenizer of another model?)"
        )
    windows = min(len(tokens), max_tokens) // seq_len
    if windows == 0:
        raise ValueError(f"calibration text has {len(tokens)} tokens, fewer than one window of {seq_len}")
    ids = tokens[: windows * seq_len].reshape(windows, seq_len)
    fn = jax.jit(lambda p, x: forward_hidden(model.merge(p), x, jnp.ones(x.shape, bool), collect_kv=True)[1])
    ks, vs = [], []
    for start in tqdm(range(0, windows, batch_size), desc="calibration forward", disable=not progress):
        k, v = fn(model.params, jnp.asarray(ids[start : start + batch_size]))  # [L, b, T, K, D]
        ks.append(k.astype(jnp.float32).reshape(k.shape[0], -1, *k.shape[3:]))
        vs.append(v.astype(jnp.float32).reshape(v.shape[0], -1, *v.shape[3:]))
    return jnp.concatenate(ks, axis=1), jnp.concatenate(vs, axis=1)


SAMPLE_POINTS = 16384  # k-means vectors per problem that `default_points_per_centroid` aims at


def default_points_per_centroid(bits: int) -> int:
    """Vectors sampled per centroid for codes of `bits` bits: about SAMPLE_POINTS per k-means problem and
    at least 64 a centroid (8-bit codes: 64; 4-bit: 1,024). On SmolLM2 at 8K, 4-bit ds 1 codebooks from
    64 a centroid (1,024 vectors a problem) cost +2.4% perplexity, from 1,024 a centroid +1.4%."""
    return max(64, SAMPLE_POINTS >> bits)


def calibrate(
    model: Model,
    token_stream: np.ndarray,
    ds: int = 2,
    bits: int = 8,
    granularity: Granularity = "shared",
    iters: int = 25,
    *,
    seq_len: int = 512,
    max_tokens: int = 16384,
    seed: int = 0,
    progress: bool = False,
    source: str = "",
    points_per_centroid: int = 256,
    tol: float = 0.0,
    weighting: Weighting = "none",
) -> Codebooks:
    """Codebooks for `model` from its post-RoPE K/V over `token_stream` (keep it apart from evaluation text).

    `weighting="attention"` weights each channel by its effect on attention (`channel_weights`): the
    query second moments for keys, the W_o row norms for values."""
    if not isinstance(model, Model):
        raise ValueError(f"calibrate needs a full-attention jaxlongctx Model, got {type(model).__name__}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    keys, values = collect_kv(model, token_stream, seq_len, max_tokens, progress=progress)
    weights = {}
    if weighting == "attention":
        used = np.asarray(token_stream, np.int32).reshape(-1)[: keys.shape[1]]  # the windows collect_kv read
        moments = query_second_moments(model, used.reshape(-1, seq_len), progress=progress)
        weights = dict(zip(("key_weights", "value_weights"), attention_weights(model, moments, granularity)))
    per_problem = (
        keys.shape[1]
        * {"shared": keys.shape[0] * keys.shape[2], "layer": keys.shape[2], "layer_head": 1}[granularity]
    )
    if per_problem < 2**bits:
        raise ValueError(
            f"{keys.shape[1]} calibration tokens give {per_problem} vectors per k-means problem, "
            f"fewer than the {2**bits} centroids; use more calibration text"
        )
    cb = train_codebooks(
        keys,
        values,
        ds,
        bits,
        granularity,
        iters,
        key=jax.random.key(seed),
        progress=progress,
        model_fingerprint=model_fingerprint(model),
        points_per_centroid=points_per_centroid,
        tol=tol,
        **weights,
    )
    meta = {**cb.metadata, "calibration_tokens": int(keys.shape[1]), "seq_len": seq_len, "seed": seed}
    if source:
        meta["calibration_source"] = source
    return dataclasses.replace(cb, metadata=meta)
