"""Rotary position embeddings in HF's half-split ("rotate_half") layout, with llama3/linear scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxlongctx.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair rotation frequencies `[hd/2]` (float32), with the config's rope scaling applied."""
    hd = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    scaling = config.rope_scaling
    if scaling is None:
        pass
    elif scaling["rope_type"] == "linear":
        inv = inv / scaling["factor"]
    elif scaling["rope_type"] == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv.astype(np.float32)


def rope_tables(positions: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin tables `[B, T, hd]` (float32) for integer positions `[B, T]`."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # B T hd/2
    angles = jnp.concatenate([angles, angles], axis=-1)  # B T hd
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate `x [..., T, heads, hd]` by tables `[..., T, hd]`; computed in float32, returned in x.dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[..., None, :] + rotated * sin[..., None, :]
    return out.astype(x.dtype)
