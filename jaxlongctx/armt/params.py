"""`MemoryParams`: the memory parameters ARMT adds to a Llama model (memory tokens and memory weights)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.memory import MemoryWeights


class MemoryParams(nnx.Module):
    """The memory tokens `memory [M, D]` (attribute name kept: it is the checkpoint key), the sink row
    `sink [1, D]` (with `armt.sink`) and the memory weights of every layer, `W_mq, W_mk [L, D, d_mem]`,
    `W_mv [L, D, D]`, `W_mb [L, D]`, `b_mb [L]` (`[L, D, nb]`, `[L, nb]` with several memory heads or
    gating, see `ARMTConfig.beta_width`), with the reference initialisation (W_mv zeros, so the memory
    state A stays 0; the sink N(0, 1))."""

    def __init__(
        self,
        armt: ARMTConfig,
        num_layers: int,
        hidden: int,
        embed_std: float,
        *,
        dtype: jnp.dtype,
        key: jax.Array,
    ):
        km, kq, kk, kb, kbb = jax.random.split(key, 5)
        bound = hidden**-0.5  # torch nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))

        def uniform(k: jax.Array, shape: tuple[int, ...]) -> nnx.Param:
            return nnx.Param(jax.random.uniform(k, shape, jnp.float32, -bound, bound).astype(dtype))

        self.memory = nnx.Param(
            (embed_std * jax.random.normal(km, (armt.num_mem_tokens, hidden), jnp.float32)).astype(dtype)
        )
        self.wq = uniform(kq, (num_layers, hidden, armt.d_mem))
        self.wk = uniform(kk, (num_layers, hidden, armt.d_mem))
        self.wv = nnx.Param(jnp.zeros((num_layers, hidden, hidden), dtype))
        nb = armt.beta_width(hidden)
        self.wb = uniform(kb, (num_layers, hidden) if nb == 1 else (num_layers, hidden, nb))
        self.bb = uniform(kbb, (num_layers,) if nb == 1 else (num_layers, nb))
        if armt.sink:
            self.sink = nnx.Param(
                jax.random.normal(jax.random.fold_in(key, 1), (1, hidden), jnp.float32).astype(dtype)
            )

    def layers(self) -> MemoryWeights:
        """The memory weights of every layer as a pytree of `[L, ...]` arrays."""
        return MemoryWeights(self.wq[...], self.wk[...], self.wv[...], self.wb[...], self.bb[...])

    def randomize(self, key: jax.Array, scale: float = 1.0) -> None:
        """Replace W_mq, W_mk, W_mv, W_mb, b_mb by `normal * scale / sqrt(D)` (bias: `normal * scale`),
        in place; gives a non-trivial memory state (the reference init keeps A == 0 forever)."""
        hidden = self.wv.shape[-1]
        for k, name in zip(jax.random.split(key, 5), ("wq", "wk", "wv", "wb", "bb")):
            p = getattr(self, name)
            std = scale if name == "bb" else scale * hidden**-0.5
            p.set_value((std * jax.random.normal(k, p.shape, jnp.float32)).astype(p.dtype))
