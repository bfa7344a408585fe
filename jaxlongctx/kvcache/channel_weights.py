"""Per-channel weights that make PQ k-means and encoding minimise attention error, not plain K/V error.

A key error e changes the score of query q by q . e, whose expected square is about
sum_j E[q_j^2] e_j^2 (cross terms dropped): key channel j is weighted by the second moment of the
post-RoPE queries that read its kv head. A value error e reaches the residual stream through W_o,
|W_o^T e|^2 ~ sum_j |W_o[j, :]|^2 e_j^2: value channel j is weighted by the squared norm of its W_o
rows (summed over the query heads of the group). Weights are averaged to the codebook granularity
and normalised to mean 1 per codebook.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxlongctx.model.attention import causal_prefill_attention
from jaxlongctx.model.llama import positions_from_mask
from jaxlongctx.model.model import Model

Weighting = Literal["none", "attention"]
WEIGHTINGS: tuple[str, ...] = ("none", "attention")


def query_second_moments(
    model: Model, windows: np.ndarray, batch_size: int = 4, progress: bool = False
) -> jnp.ndarray:
    """E[q_j^2] of post-RoPE queries `[L, H, D]` over token windows `[N, T]` (each its own sequence)."""
    windows = np.asarray(windows, np.int32)
    if windows.ndim != 2 or windows.size == 0:
        raise ValueError(f"windows must be a non-empty [N, T] array of token ids, got shape {windows.shape}")

    def moments(params, x):  # x [b, T] -> summed q^2 [L, H, D]
        module = model.merge(params)
        mask = jnp.ones(x.shape, bool)
        cos, sin = module.rope(positions_from_mask(mask))

        def attend(q, k, v):  # exact causal attention; the queries' summed squares are the aux output
            return causal_prefill_attention(q, k, v, mask), jnp.sum(
                jnp.square(q.astype(jnp.float32)), axis=(0, 1)
            )

        def body(layer, h, _):
            return layer(h, cos, sin, attend)

        return module.scan_layers(body, module.embed_ids(x))[1]

    fn = jax.jit(moments)
    total = 0.0
    for start in tqdm(range(0, len(windows), batch_size), desc="query moments", disable=not progress):
        total = total + fn(model.params, jnp.asarray(windows[start : start + batch_size]))
    return total / windows.size


def attention_weights(
    model: Model, query_moments: jnp.ndarray, granularity: str
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(key, value) channel weights for a codebook granularity: `[D]`, `[L, D]` or `[L, K, D]`, mean 1 each."""
    cfg = model.config
    layers, heads, kv, hd = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if query_moments.shape != (layers, heads, hd):
        raise ValueError(f"query moments must have shape {(layers, heads, hd)}, got {query_moments.shape}")
    key = query_moments.reshape(layers, kv, heads // kv, hd).mean(axis=2)  # [L, K, D]
    wo = jnp.asarray(model.module.layers.wo[...], jnp.float32)  # [L, H * hd, d_model]
    value = jnp.sum(jnp.square(wo.reshape(layers, kv, heads // kv, hd, -1)), axis=(2, 4))  # [L, K, D]
    axes = {"shared": (0, 1), "layer": (1,), "layer_head": ()}[granularity]

    def reduce(w):
        w = jnp.mean(w, axis=axes) if axes else w
        w = w / jnp.mean(w, axis=-1, keepdims=True)
        return jnp.maximum(w, 1e-6)  # a channel no query reads still gets a (tiny) positive weight

    return reduce(key), reduce(value)
