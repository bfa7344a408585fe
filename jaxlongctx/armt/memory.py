"""The associative memory (spec 1.3-1.5): DPFP feature map, read and write of one layer, and the
per-layer memory state of a whole model (`MemoryState`, `zero_state`) that every schedule carries.

Words: the *memory state* is the associative memory itself, `A` and `z` per layer (what a schedule
carries from segment to segment); the *memory weights* (`MemoryWeights`: W_mq, W_mk, W_mv, W_mb,
b_mb) are the learned projections that read and write it; the *memory tokens* are the learned
embeddings appended to every segment (see `jaxlongctx.armt.params`).

Pure functions. Whatever the weight dtype, the projections accumulate in float32 and the read and
write arithmetic on the state `A [B, d_key, D]`, `z [B, d_key]` runs in float32; the updated state is
cast back to its own dtype. Read and write accept extra leading axes (a grouped diagonal step's `G`)
and take the projection as a `Project` function (default `project`, a plain product).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlongctx.armt.config import EPS, NU, ARMTConfig
from jaxlongctx.sharding import memory_state_shardings, reshard_like


class MemoryWeights(NamedTuple):
    """Memory weights (the read/write projections) of one layer (or of all layers, stacked `[L, ...]`)."""

    wq: jnp.ndarray  # D d_mem
    wk: jnp.ndarray  # D d_mem
    wv: jnp.ndarray  # D D
    wb: jnp.ndarray  # D     (W_mb: d -> 1); D nb with several memory heads or gating (nb: H or D)
    bb: jnp.ndarray  # ()    (its bias); nb


class MemoryState(NamedTuple):
    """The memory state (the associative memory of every layer): A `[L, B, d_key, D / H]`, z
    `[L, B, d_key]` (state dtype; `H` memory heads stacked along d_key) and, with a sliding window,
    each layer's previous-segment token keys and values `wk, wv [L, B, S, K, hd]` (post-RoPE, model
    dtype) and how many of them are real `wn [L, B]` (0: no window)."""

    A: jnp.ndarray
    z: jnp.ndarray
    wk: jnp.ndarray | None = None
    wv: jnp.ndarray | None = None
    wn: jnp.ndarray | None = None


def zero_state(model: Any, batch: int) -> MemoryState:
    """All-zero memory state for `batch` rows (no window)."""
    cfg, armt = model.config, model.armt
    L = cfg.num_layers
    state = MemoryState(
        jnp.zeros((L, batch, armt.d_key, cfg.hidden_size // armt.mem_heads), armt.state_dtype),
        jnp.zeros((L, batch, armt.d_key), armt.state_dtype),
    )
    if armt.sliding_window:
        window = (L, batch, armt.segment_size, cfg.num_kv_heads, cfg.head_dim)
        state = state._replace(
            wk=jnp.zeros(window, model.dtype),
            wv=jnp.zeros(window, model.dtype),
            wn=jnp.zeros((L, batch), jnp.int32),
        )
    mesh = model.base.mesh
    if mesh is None:
        return state
    shardings = memory_state_shardings(mesh, batch)
    return MemoryState(
        *(None if x is None else jax.device_put(x, shardings[name]) for name, x in state._asdict().items())
    )


def project(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """`x [..., D] @ w [D, E]` accumulated and returned in float32."""
    return jnp.einsum("...d,de->...e", x, w, preferred_element_type=jnp.float32)


Project = Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray]  # (x [..., D], weight) -> float32 x @ weight


def dpfp(x: jnp.ndarray) -> jnp.ndarray:
    """DPFP feature map, nu = 3, no normalisation: `[..., d_mem]` -> float32 `[..., 2 * NU * d_mem]`."""
    x = x.astype(jnp.float32)
    xp = jnp.concatenate([jax.nn.relu(x), jax.nn.relu(-x)], axis=-1)
    rolled = jnp.concatenate([jnp.roll(xp, shift=j, axis=-1) for j in range(1, NU + 1)], axis=-1)
    return jnp.concatenate([xp] * NU, axis=-1) * rolled


def features(x: jnp.ndarray, cfg: ARMTConfig) -> jnp.ndarray:
    """Per-head DPFP features of projections `x [..., d_mem]` -> float32 `[..., H, f]` (f = 6 d_mem / H),
    L2-normalised per head with `cfg.normalize_features` (`x / max(|x|, 1e-12)`)."""
    phi = dpfp(x.reshape(*x.shape[:-1], cfg.mem_heads, cfg.d_mem // cfg.mem_heads))
    if cfg.normalize_features:
        phi = phi / jnp.maximum(jnp.linalg.norm(phi, axis=-1, keepdims=True), 1e-12)
    return phi


def _reshape_last(x: jnp.ndarray, shape: tuple[int, ...], keep: int) -> jnp.ndarray:
    """`x` with its trailing axes after the first `keep` reshaped to `shape`; on a mesh the new last
    axis takes the old last axis's layout (memory heads split or merged over a tp-split value axis)."""
    new = (*x.shape[:keep], *shape)
    sharding = jax.typeof(x).sharding
    if sharding.mesh.empty:
        return x.reshape(new)
    spec = (*tuple(sharding.spec)[:keep], *(None,) * (len(shape) - 1), tuple(sharding.spec)[-1])
    return jax.lax.reshape(x, new, out_sharding=NamedSharding(sharding.mesh, P(*spec)))


def _heads(A: jnp.ndarray, z: jnp.ndarray, heads: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """State `A [..., dk, c]`, `z [..., dk]` -> float32 per head `[..., H, f, c]`, `[..., H, f]`."""
    A = A.astype(jnp.float32)
    return A.reshape(*A.shape[:-2], heads, -1, A.shape[-1]), z.astype(jnp.float32).reshape(
        *z.shape[:-1], heads, -1
    )


def read(
    h: jnp.ndarray,
    weights: MemoryWeights,
    A: jnp.ndarray,
    z: jnp.ndarray,
    cfg: ARMTConfig,
    proj: Project = project,
) -> jnp.ndarray:
    """`h + concat_heads phi(h W_mq) A / (phi(h W_mq) . z + eps)` for every row (no division without
    `use_denom`): h `[B, T, D]` -> `[B, T, D]`."""
    q = features(proj(h, weights.wq), cfg)  # B T H f
    a, zz = _heads(A, z, cfg.mem_heads)
    num = jnp.einsum("...thf,...hfc->...thc", q, a)
    if cfg.use_denom:
        num = num / (jnp.einsum("...thf,...hf->...th", q, zz) + EPS)[..., None]
    num = _reshape_last(num, (num.shape[-2] * num.shape[-1],), num.ndim - 2)  # B T D
    num = reshard_like(num, h)  # on a mesh: gather A's value columns (split over tp) once per layer
    return (h.astype(jnp.float32) + num).astype(h.dtype)


def write(
    m: jnp.ndarray,
    weights: MemoryWeights,
    A: jnp.ndarray,
    z: jnp.ndarray,
    first: jnp.ndarray,
    cfg: ARMTConfig,
    proj: Project = project,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Update `A [B, dk, c]`, `z [B, dk]` from the layer output at the memory-token rows `m [B, M, D]`;
    rows with `first [B]` use the first-segment rule (vbar = 0, gamma = 1)."""
    H = cfg.mem_heads
    k = features(proj(m, weights.wk), cfg)  # B M H f
    v = proj(m, weights.wv)  # B M D
    v = _reshape_last(v, (H, v.shape[-1] // H), v.ndim - 1)  # B M H c
    one_beta = cfg.beta_width(m.shape[-1]) == 1  # W_mb [.., D] and b_mb [..] (spec/armt.md)
    logit = proj(m, weights.wb[..., None] if one_beta else weights.wb)  # B M nb (nb: 1, H or D)
    bias = weights.bb.astype(jnp.float32)  # [nb] per layer, [G, nb] on a grouped step
    bias = bias[..., None] if one_beta else bias
    bias = bias.reshape(*bias.shape[:-1], *(1,) * (logit.ndim - bias.ndim), bias.shape[-1])
    beta = jax.nn.sigmoid(logit + bias)  # B M nb
    beta = beta.reshape(*beta.shape[:-1], H, -1)  # B M H (1 or c)
    a32, z32 = _heads(A, z, H)
    if cfg.use_denom:
        den = jnp.einsum("...mhf,...hf->...mh", k, z32) + EPS
        vbar = jnp.einsum("...mhf,...hfc->...mhc", k, a32) / den[..., None]
        if cfg.correction:
            norm2 = jnp.sum(k * k, axis=-1) + cfg.gamma_eps
            gamma = jax.lax.stop_gradient(jnp.clip(1.0 - den / norm2, 0.0, 1.0))
        else:
            gamma = jnp.ones_like(den)
        gamma = jnp.where(first[..., None, None], 1.0, gamma)
    else:
        vbar = jnp.einsum("...mhf,...hfc->...mhc", k, a32)
    vbar = jnp.where(first[..., None, None, None], 0.0, vbar)
    a32 = a32 + jnp.einsum("...mhf,...mhc->...hfc", k, beta * (v - vbar))
    if cfg.use_denom:
        z32 = z32 + jnp.einsum("...mh,...mhf->...hf", gamma, k)
    return a32.reshape(A.shape).astype(A.dtype), z32.reshape(z.shape).astype(z.dtype)
