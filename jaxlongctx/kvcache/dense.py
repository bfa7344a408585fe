"""Static, preallocated dense KV cache for full-attention decoding."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from jaxlongctx.config import ModelConfig


class DenseCache(NamedTuple):
    """Per-layer keys/values in fixed slots; written in place (buffers are donated each step).

    k, v `[L, B, S, K, hd]`; key_valid `[B, S]` marks slots holding real tokens.
    """

    k: jnp.ndarray
    v: jnp.ndarray
    key_valid: jnp.ndarray

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, capacity: int, dtype: jnp.dtype) -> DenseCache:
        """An empty cache of `capacity` slots."""
        shape = (config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch, capacity), bool))

    @classmethod
    def from_prefill(cls, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray, capacity: int) -> DenseCache:
        """A cache of `capacity` slots holding prefill keys/values `[L, B, T, K, hd]` in slots `[0, T)`;
        padding keeps the inputs' sharding (kv heads over tp, batch over dp) on a mesh."""
        pad = capacity - k.shape[2]
        slots = ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))
        return cls(jnp.pad(k, slots), jnp.pad(v, slots), jnp.pad(mask, ((0, 0), (0, pad))))

    @property
    def capacity(self) -> int:
        """Number of token slots."""
        return self.k.shape[2]

    def nbytes(self) -> int:
        """Bytes held by the cache buffers."""
        return sum(int(x.size) * x.dtype.itemsize for x in self)


def dense_cache_bytes(config: ModelConfig, tokens: int, batch: int = 1, itemsize: int = 2) -> int:
    """Bytes a dense K+V cache of `tokens` tokens needs (default bf16)."""
    return 2 * config.num_layers * batch * tokens * config.num_kv_heads * config.head_dim * itemsize
