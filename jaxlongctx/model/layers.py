"""One Llama decoder layer as an NNX module, called with the attention strategy of its schedule.

A layer is `h -> h + attn(norm(h)) -> h + mlp(norm(h))`. Schedules (full forward, cached decode,
perplexity with a K/V transform, ARMT segments and decoding, PQ decode) differ only in how attention
sees keys, so `DecoderLayer.__call__(h, cos, sin, attend)` takes that part as an `Attend` function
(`jaxlongctx.model.attention_strategies` holds one per schedule): it gets the post-RoPE q/k/v and
returns the attention output and whatever the caller needs back (new cache entries, K/V to collect).

The layer takes the matrix product as a `Dense` function (default: `sharding.matmul`, the plain
product that all-reduces a row-parallel one) and accepts any leading axes. ARMT's grouped diagonal
step uses that: its layer holds the stacked weights `[L, in, out]` whole, a leading group axis `G` on
every vector parameter and on the activations, and a `Dense` that multiplies group g by layer `first + g`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlongctx.config import ModelConfig
from jaxlongctx.model.rope import apply_rope
from jaxlongctx.sharding import matmul
from pallas_kernels.layer_matvec_cpu import rms_norm  # the model's RMSNorm, as the kernel computes it

Dense = Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray]  # (x [..., in], weight) -> x @ weight [..., out]


@dataclasses.dataclass(frozen=True)
class FusedDense:
    """A `Dense` that also multiplies one input by several weights in one call (`many`), and does so
    after RMS-normalising the input (`normed(h, gain, eps, weights)`): the layer's norm and q/k/v
    products, and its post-norm and gate/up products, then cost one kernel call each (the in-place
    CPU decode kernel)."""

    one: Dense
    many: Callable[[jnp.ndarray, tuple[jnp.ndarray, ...]], tuple[jnp.ndarray, ...]]
    normed: Callable[[jnp.ndarray, jnp.ndarray, float, tuple[jnp.ndarray, ...]], tuple[jnp.ndarray, ...]]

    def __call__(self, x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
        return self.one(x, w)


def products(dense: Dense, x: jnp.ndarray, weights: tuple[jnp.ndarray, ...]) -> tuple[jnp.ndarray, ...]:
    """`x` times each of `weights`: one call of a `FusedDense`, else one `dense` product each."""
    if isinstance(dense, FusedDense):
        return dense.many(x, weights)
    return tuple(dense(x, w) for w in weights)


def normed_products(
    dense: Dense, h: jnp.ndarray, gain: jnp.ndarray, eps: float, weights: tuple[jnp.ndarray, ...]
) -> tuple[jnp.ndarray, ...]:
    """`rms_norm(h)` times each of `weights`: one call of a `FusedDense`, else the norm, then `products`."""
    if isinstance(dense, FusedDense):
        return dense.normed(h, gain, eps, weights)
    return products(dense, rms_norm(h, per_layer(gain, h), eps), weights)


# (q [..., T, H, hd], k [..., T, K, hd], v [..., T, K, hd]), post-RoPE -> (out [..., T, H, hd], aux)
Attend = Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray], tuple[jnp.ndarray, Any]]


def per_layer(v: jnp.ndarray, like: jnp.ndarray) -> jnp.ndarray:
    """A layer's vector parameter `[X]`, or `[G, X]` with a leading group axis, shaped to broadcast
    against activations `like [..., X]` (`[G, ..., X]`)."""
    if v.ndim == 1:
        return v
    return v.reshape(*v.shape[:-1], *(1,) * (like.ndim - v.ndim), v.shape[-1])


def _dense_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


class DecoderLayer(nnx.Module):
    """Parameters and math of one decoder layer (weights stored `(in, out)`)."""

    def __init__(self, config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
        h, kv = config.num_heads, config.num_kv_heads
        self.config = config
        self.input_norm = nnx.Param(jnp.ones((d,), dtype))
        self.wq = _dense_init(rngs, (d, h * hd), dtype)
        self.wk = _dense_init(rngs, (d, kv * hd), dtype)
        self.wv = _dense_init(rngs, (d, kv * hd), dtype)
        self.wo = _dense_init(rngs, (h * hd, d), dtype)
        if config.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((h * hd,), dtype))
            self.bk = nnx.Param(jnp.zeros((kv * hd,), dtype))
            self.bv = nnx.Param(jnp.zeros((kv * hd,), dtype))
        if config.o_bias:
            self.bo = nnx.Param(jnp.zeros((d,), dtype))
        if config.qk_norm:
            self.q_norm = nnx.Param(jnp.ones((hd,), dtype))
            self.k_norm = nnx.Param(jnp.ones((hd,), dtype))
        self.post_norm = nnx.Param(jnp.ones((d,), dtype))
        self.w_gate = _dense_init(rngs, (d, f), dtype)
        self.w_up = _dense_init(rngs, (d, f), dtype)
        self.w_down = _dense_init(rngs, (f, d), dtype)

    def __call__(
        self, h: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, attend: Attend, dense: Dense = matmul
    ) -> tuple[jnp.ndarray, Any]:
        """The layer on h `[..., T, D]` with RoPE tables cos/sin `[..., T, hd]`; `attend` computes the
        attention from the post-RoPE q/k/v. Returns the layer output `[..., T, D]` and `attend`'s aux."""
        q, k, v = self._project_qkv(h, cos, sin, dense)
        attn_out, aux = attend(q, k, v)
        return self._finish(h, attn_out, dense), aux

    def _project_qkv(
        self, h: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, dense: Dense = matmul
    ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
        """Input norm, q/k/v projections, optional q/k norm and RoPE.

        h `[..., T, D]`, cos/sin `[..., T, hd]` -> q `[..., T, H, hd]`, k and v `[..., T, K, hd]` (post-RoPE).
        """
        cfg = self.config
        lead = h.shape[:-1]
        q, k, v = normed_products(
            dense, h, self.input_norm[...], cfg.rms_norm_eps, (self.wq[...], self.wk[...], self.wv[...])
        )
        if cfg.qkv_bias:
            q, k, v = (
                q + per_layer(self.bq[...], q),
                k + per_layer(self.bk[...], k),
                v + per_layer(self.bv[...], v),
            )
        q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
        k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, per_layer(self.q_norm[...], q), cfg.rms_norm_eps)
            k = rms_norm(k, per_layer(self.k_norm[...], k), cfg.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish(self, h: jnp.ndarray, attn_out: jnp.ndarray, dense: Dense = matmul) -> jnp.ndarray:
        """Output projection + residual, then post-norm SwiGLU MLP + residual.

        h `[..., T, D]` (the layer input), attn_out `[..., T, H, hd]` -> `[..., T, D]`.
        """
        cfg = self.config
        # row parallel under tp (o and down): one all-reduce each
        o = dense(attn_out.reshape(*h.shape[:-1], cfg.num_heads * cfg.head_dim), self.wo[...])
        if cfg.o_bias:
            o = o + per_layer(self.bo[...], o)
        h = h + o
        gate, up = normed_products(
            dense, h, self.post_norm[...], cfg.rms_norm_eps, (self.w_gate[...], self.w_up[...])
        )
        gated = jax.nn.silu(gate) * up
        return h + dense(gated, self.w_down[...])


def stacked_layers(config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """`config.num_layers` decoder layers whose every parameter has a leading layer axis `[L, ...]`."""

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(config, dtype=dtype, rngs=rngs)

    return make(rngs)
