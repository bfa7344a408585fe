"""Static, preallocated dense KV cache for full-attention decoding."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jaxlongctx.config import ModelConfig


class DenseCache(NamedTuple):
    """Per-layer keys/values in fixed slots; written in place (buffers are donated each step).

    k, v `[L, B, K, S, hd]` (kv heads before slots: each head's keys are contiguous, so decode
    attention needs no per-step move of the head axis); key_valid `[B, S]` marks slots holding real tokens.
    """

    k: jnp.ndarray
    v: jnp.ndarray
    key_valid: jnp.ndarray

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, capacity: int, dtype: jnp.dtype) -> DenseCache:
        """An empty cache of `capacity` slots."""
        shape = (config.num_layers, batch, config.num_kv_heads, capacity, config.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch, capacity), bool))

    @classmethod
    def from_prefill(cls, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray, capacity: int) -> DenseCache:
        """A cache of `capacity` slots holding prefill keys/values `[L, B, T, K, hd]` in slots `[0, T)`;
        the layout change and padding keep the inputs' sharding (kv heads over tp, batch over dp)."""
        pad = capacity - k.shape[2]
        slots = ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0))
        k, v = (jnp.pad(x.transpose(0, 1, 3, 2, 4), slots) for x in (k, v))
        return cls(k, v, jnp.pad(mask, ((0, 0), (0, pad))))

    @property
    def capacity(self) -> int:
        """Number of token slots."""
        return self.k.shape[3]

    def nbytes(self) -> int:
        """Bytes held by the cache buffers."""
        return sum(int(x.size) * x.dtype.itemsize for x in self)


def dense_cache_bytes(config: ModelConfig, tokens: int, batch: int = 1, itemsize: int = 2) -> int:
    """Bytes a dense K+V cache of `tokens` tokens needs (default bf16)."""
    return 2 * config.num_layers * batch * tokens * config.num_kv_heads * config.head_dim * itemsize
