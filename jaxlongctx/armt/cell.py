"""One ARMT cell: one segment through one layer (associative memory read, decoder layer, write).

A segment buffer has `R = S + M` rows: `S` token slots (the first `n` of them real) then the `M`
memory-token rows. Memory-token rows get RoPE positions `n .. n + M - 1`, missing token slots are
invalid keys, so every short segment is computed exactly as if it had been cut to `n + M` rows. A
segment with `n == 0` (padding) never writes the associative memory. `first` marks a row's first
segment of a document: it starts from a zero memory state and uses the first-segment write rule.

The cell also runs several layers at once (a grouped diagonal step): every input then carries a
leading group axis `G`, the layer and the memory weights hold the group's weights, and `dense` and
`project` multiply group g by its own layer's weights.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.memory import MemoryWeights, Project, project, read, write
from jaxlongctx.model.attention_strategies import CausalPrefill
from jaxlongctx.model.layers import DecoderLayer, Dense
from jaxlongctx.model.llama import Llama
from jaxlongctx.model.rope import rope_tables
from jaxlongctx.sharding import matmul, reshard_like

CELL_ATTENTION_CHUNK = 256  # query rows per attention block in a cell (keys: the causal prefix only)


def segment_layout(n: jnp.ndarray, cfg: ARMTConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """RoPE positions `[B, R]` and key validity `[B, R]` of segment buffers holding `n [B]` tokens."""
    i = jnp.arange(cfg.rows)
    positions = jnp.where(i < cfg.segment_size, i, n[..., None] + i - cfg.segment_size)
    key_valid = (i < n[..., None]) | (i >= cfg.segment_size)
    return positions, key_valid


def embed_segment(base: Llama, memory_tokens: jnp.ndarray, ids: jnp.ndarray) -> jnp.ndarray:
    """Segment buffer `[B, R, D]`: token embeddings of ids `[B, S]` then the memory tokens `[M, D]`."""
    tok = base.embed_ids(ids)
    rows = jnp.broadcast_to(memory_tokens.astype(tok.dtype), (tok.shape[0], *memory_tokens.shape))
    return jnp.concatenate([tok, reshard_like(rows, tok)], axis=1)


def cell(
    cfg: ARMTConfig,
    inv_freq: np.ndarray,
    layer: DecoderLayer,
    weights: MemoryWeights,
    h: jnp.ndarray,
    A: jnp.ndarray,
    z: jnp.ndarray,
    n: jnp.ndarray,
    first: jnp.ndarray,
    dense: Dense = matmul,
    proj: Project = project,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Segment buffers `h [B, R, D]` through one layer with its memory weights and memory state
    `A [B, dk, D]`, `z [B, dk]`; `n [B]` tokens per row, `first [B]`. Returns the layer output and the
    updated state. The buffer's row i attends to its valid rows <= i (memory tokens after the tokens)."""
    a0 = jnp.where(first[..., None, None], 0, A).astype(A.dtype)
    z0 = jnp.where(first[..., None], 0, z).astype(z.dtype)
    h = read(h, weights, a0, z0, proj)
    positions, key_valid = segment_layout(n, cfg)
    cos, sin = rope_tables(positions, inv_freq)
    h, _ = layer(h, cos, sin, CausalPrefill(key_valid, chunk=CELL_ATTENTION_CHUNK), dense)
    a1, z1 = write(h[..., cfg.segment_size :, :], weights, a0, z0, first, proj)
    writes = n > 0
    return h, jnp.where(writes[..., None, None], a1, A), jnp.where(writes[..., None], z1, z)
