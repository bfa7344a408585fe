"""One Llama decoder layer as an NNX module, split into the pieces every schedule composes.

A layer is `h -> h + attn(norm(h)) -> h + mlp(norm(h))`. Schedules (full forward, cached decode,
ARMT segments) differ only in how attention sees keys, so the layer exposes `project_qkv` (norm,
projections, q/k norm, RoPE) and `finish` (output projection, residual, MLP) around it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlongctx.config import ModelConfig
from jaxlongctx.model.rope import apply_rope
from jaxlongctx.parallel import sharding_like


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMSNorm computed in float32 and cast back to x.dtype before the weight (HF order)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


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

    def project_qkv(self, h: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray
                    ) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
        """Input norm, q/k/v projections, optional q/k norm and RoPE.

        h `[B, T, D]`, cos/sin `[B, T, hd]` -> q `[B, T, H, hd]`, k and v `[B, T, K, hd]` (post-RoPE).
        """
        cfg = self.config
        b, t, _ = h.shape
        x = rms_norm(h, self.input_norm[...], cfg.rms_norm_eps)
        q, k, v = x @ self.wq[...], x @ self.wk[...], x @ self.wv[...]
        if cfg.qkv_bias:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...], cfg.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, h: jnp.ndarray, attn_out: jnp.ndarray) -> jnp.ndarray:
        """Output projection + residual, then post-norm SwiGLU MLP + residual.

        h `[B, T, D]` (the layer input), attn_out `[B, T, H, hd]` -> `[B, T, D]`.
        """
        cfg = self.config
        b, t, _ = h.shape
        o = jnp.matmul(attn_out.reshape(b, t, cfg.num_heads * cfg.head_dim), self.wo[...],
                       out_sharding=sharding_like(h))  # row parallel: one all-reduce under tp
        if cfg.o_bias:
            o = o + self.bo[...]
        h = h + o
        x = rms_norm(h, self.post_norm[...], cfg.rms_norm_eps)
        gated = jax.nn.silu(x @ self.w_gate[...]) * (x @ self.w_up[...])
        return h + jnp.matmul(gated, self.w_down[...], out_sharding=sharding_like(h))


def stacked_layers(config: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """`config.num_layers` decoder layers whose every parameter has a leading layer axis `[L, ...]`."""

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(config, dtype=dtype, rngs=rngs)

    return make(rngs)
