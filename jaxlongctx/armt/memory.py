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

from jaxlongctx.armt.config import NU
from jaxlongctx.sharding import memory_state_shardings, reshard_like

EPS = 1e-5  # the three literal eps sites of the reference (read, write and gamma denominators)


class MemoryWeights(NamedTuple):
    """Memory weights (the read/write projections) of one layer (or of all layers, stacked `[L, ...]`)."""

    wq: jnp.ndarray  # D d_mem
    wk: jnp.ndarray  # D d_mem
    wv: jnp.ndarray  # D D
    wb: jnp.ndarray  # D     (W_mb: d -> 1)
    bb: jnp.ndarray  # ()    (its bias)


class MemoryState(NamedTuple):
    """The memory state (the associative memory of every layer): A `[L, B, d_key, D]`, z `[L, B, d_key]`
    (state dtype)."""

    A: jnp.ndarray
    z: jnp.ndarray


def zero_state(model: Any, batch: int) -> MemoryState:
    """All-zero memory state for `batch` rows."""
    cfg, armt = model.config, model.armt
    state = MemoryState(
        jnp.zeros((cfg.num_layers, batch, armt.d_key, cfg.hidden_size), armt.state_dtype),
        jnp.zeros((cfg.num_layers, batch, armt.d_key), armt.state_dtype),
    )
    mesh = model.base.mesh
    if mesh is None:
        return state
    shardings = memory_state_shardings(mesh, batch)
    return MemoryState(*(jax.device_put(x, shardings[name]) for name, x in state._asdict().items()))


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


def read(
    h: jnp.ndarray, weights: MemoryWeights, A: jnp.ndarray, z: jnp.ndarray, proj: Project = project
) -> jnp.ndarray:
    """`h + phi(h W_mq) A / (phi(h W_mq) . z + eps)` for every row: h `[B, T, D]` -> `[B, T, D]`."""
    q = dpfp(proj(h, weights.wq))  # B T dk
    num = jnp.einsum("...tk,...kd->...td", q, A.astype(jnp.float32))
    den = jnp.einsum("...tk,...k->...t", q, z.astype(jnp.float32)) + EPS
    num = reshard_like(num, h)  # on a mesh: gather A's value columns (split over tp) once per layer
    return (h.astype(jnp.float32) + num / den[..., None]).astype(h.dtype)


def write(
    m: jnp.ndarray,
    weights: MemoryWeights,
    A: jnp.ndarray,
    z: jnp.ndarray,
    first: jnp.ndarray,
    proj: Project = project,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Update `A [B, dk, D]`, `z [B, dk]` from the layer output at the memory-token rows `m [B, M, D]`;
    rows with `first [B]` use the first-segment rule (vbar = 0, gamma = 1)."""
    k = dpfp(proj(m, weights.wk))  # B M dk
    v = proj(m, weights.wv)  # B M D
    logit = proj(m, weights.wb[..., None])[..., 0]  # B M
    bias = weights.bb.astype(jnp.float32)  # () per layer, [G] on a grouped step
    beta = jax.nn.sigmoid(logit + bias.reshape(*bias.shape, *(1,) * (logit.ndim - bias.ndim)))  # B M
    a32, z32 = A.astype(jnp.float32), z.astype(jnp.float32)
    den = jnp.einsum("...mk,...k->...m", k, z32) + EPS
    vbar = jnp.einsum("...mk,...kd->...md", k, a32) / den[..., None]
    gamma = jax.lax.stop_gradient(jnp.clip(1.0 - den / (jnp.sum(k * k, axis=-1) + EPS), 0.0, 1.0))
    vbar = jnp.where(first[..., None, None], 0.0, vbar)
    gamma = jnp.where(first[..., None], 1.0, gamma)
    a32 = a32 + jnp.einsum("...m,...mk,...md->...kd", beta, k, v - vbar)
    z32 = z32 + jnp.einsum("...m,...mk->...k", gamma, k)
    return a32.astype(A.dtype), z32.astype(z.dtype)
