"""Shared helpers for the ARMT tests: tiny models and an independent float64 numpy ARMT (spec 1)."""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlongctx.armt import ARMTConfig, ARMTModel
from jaxlongctx.armt.cpu_execution import PIPELINE_ALWAYS
from jaxlongctx.config import ModelConfig
from jaxlongctx.model.model import Model

VOCAB = 97
PERIOD, NEWLINE = 3, 4  # token texts of TinyTokenizer


class TinyTokenizer:
    """A `tokenizers`-like vocabulary of `vocab` ids for sentence segmentation: the ids in `periods`
    are ".", id 4 a line break, other odd ids " w<i>" (start with a space), the rest "w<i>"."""

    def __init__(self, vocab: int = VOCAB, periods: tuple[int, ...] = (PERIOD,)):
        self.vocab, self.periods = vocab, frozenset(periods)

    def get_vocab_size(self) -> int:
        return self.vocab

    def decode(self, ids: list[int]) -> str:
        (i,) = ids
        if i in self.periods:
            return "."
        return "\n" if i == NEWLINE else (f" w{i}" if i % 2 else f"w{i}")


def tiny_config(layers: int = 3) -> ModelConfig:
    """A 4-head GQA model with d = 32."""
    return ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1000.0,
    )


def make_armt(
    layers: int = 3,
    segment_size: int = 8,
    mem: int = 4,
    dtype=jnp.float32,
    state_dtype=jnp.float32,
    seed: int = 0,
) -> ARMTModel:
    """A tiny ARMT model with non-trivial norms and random (non-zero) memory weights."""
    model = Model.init(tiny_config(layers), seed=seed, dtype=dtype)
    layers_mod = model.module.layers
    key = jax.random.key(seed + 100)
    for i, name in enumerate(("input_norm", "post_norm")):
        p = getattr(layers_mod, name)
        p[...] = (1 + 0.3 * jax.random.normal(jax.random.fold_in(key, i), p.shape)).astype(dtype)
    model.module.embed[...] = (
        0.5 * jax.random.normal(jax.random.fold_in(key, 7), model.module.embed.shape)
    ).astype(dtype)
    armt = ARMTModel.wrap(
        model, ARMTConfig(segment_size, mem, d_mem=8, state_dtype=state_dtype), jax.random.key(seed + 1)
    )
    armt.cpu_execution = (
        PIPELINE_ALWAYS  # short test inputs take the pipeline too (the CPU shortcut has its test)
    )
    return armt.randomize_memory_params(jax.random.key(seed + 2), 1.0)


@cache
def shared_armt(layers: int = 3, segment_size: int = 8) -> ARMTModel:
    """One cached model per shape, so compiled schedules are reused across test files."""
    return make_armt(layers, segment_size)


# --- float64 numpy reference, written from spec/armt.md --------------------------------------------
def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, pos, theta):  # x [T, H, hd], pos [T]
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = pos[:, None] * inv[None]
    cos, sin = (
        np.cos(np.concatenate([ang, ang], -1))[:, None],
        np.sin(np.concatenate([ang, ang], -1))[:, None],
    )
    rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


def _phi(x, nu=3):
    xp = np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], -1)
    return np.concatenate([xp] * nu, -1) * np.concatenate([np.roll(xp, j, -1) for j in range(1, nu + 1)], -1)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def numpy_armt(armt: ARMTModel, ids: np.ndarray, use_memory: bool = True):
    """Logits `[T, V]` and per-layer (A, z) of one row, float64, straight from spec section 1."""
    cfg, ac = armt.config, armt.armt
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(armt.base.params))
    mp = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(armt.memory)))
    lp, L, M, d = p["layers"], cfg.num_layers, ac.num_mem_tokens, cfg.hidden_size
    H, K, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    A = [np.zeros((ac.d_key, d)) for _ in range(L)]
    z = [np.zeros(ac.d_key) for _ in range(L)]
    out = []
    for s, start in enumerate(range(0, len(ids), ac.segment_size)):
        seg = ids[start : start + ac.segment_size]
        h = np.concatenate([p["embed"][seg], mp["memory"]], 0)
        T = h.shape[0]
        pos = np.arange(T, dtype=np.float64)
        for l in range(L):
            if use_memory:
                q = _phi(h @ mp["wq"][l])
                h = h + (q @ A[l]) / (q @ z[l] + 1e-5)[:, None]
            x = _rms(h, lp["input_norm"][l], eps)
            qh = _rope((x @ lp["wq"][l]).reshape(T, H, hd), pos, cfg.rope_theta)
            kh = _rope((x @ lp["wk"][l]).reshape(T, K, hd), pos, cfg.rope_theta)
            vh = (x @ lp["wv"][l]).reshape(T, K, hd)
            kh, vh = np.repeat(kh, H // K, axis=1), np.repeat(vh, H // K, axis=1)
            sc = np.einsum("thd,shd->hts", qh, kh) / np.sqrt(hd)
            sc = np.where(np.tril(np.ones((T, T), bool))[None], sc, -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            att = np.einsum("hts,shd->thd", pr, vh).reshape(T, H * hd)
            h = h + att @ lp["wo"][l]
            x = _rms(h, lp["post_norm"][l], eps)
            g = x @ lp["w_gate"][l]
            h = h + ((g * _sigmoid(g)) * (x @ lp["w_up"][l])) @ lp["w_down"][l]
            if use_memory:
                m = h[-M:]
                k = _phi(m @ mp["wk"][l])
                v = m @ mp["wv"][l]
                beta = _sigmoid(m @ mp["wb"][l] + mp["bb"][l])
                if s == 0:
                    vbar, gamma = np.zeros_like(v), np.ones(M)
                else:
                    den = k @ z[l] + 1e-5
                    vbar = (k @ A[l]) / den[:, None]
                    gamma = np.clip(1 - den / ((k * k).sum(-1) + 1e-5), 0, 1)
                A[l] = A[l] + np.einsum("m,mk,md->kd", beta, k, v - vbar)
                z[l] = z[l] + gamma @ k
        x = _rms(h[: len(seg)], p["final_norm"], eps)
        out.append(x @ p["lm_head"])
    return np.concatenate(out, 0), A, z
