"""One ARMT cell: one segment through one layer (associative memory read, decoder layer, write).

A segment buffer has `R = lead + S + M` rows: the sink row if the config has one (`lead` = 1), `S`
token slots (the first `n` of them real), then the `M` memory-token rows. RoPE positions are local:
sink 0, tokens `lead ..`, memory-token rows `lead + n .. lead + n + M - 1`; missing token slots are
invalid keys, so every short segment is computed exactly as if it had been cut to `lead + n + M` rows.
A segment with `n == 0` (padding) never writes the memory state. `first` marks a row's first segment
of a document: it starts from a zero memory state (and no window) and uses the first-segment write rule.

Attention is causal over the buffer rows (tokens never see the memory-token rows) unless the config
asks for more (`ARMTConfig.plain_mask` false): then an explicit mask (`segment_visibility`) over the
buffer rows and, with a sliding window, the layer's previous-segment token keys and values, which the
cell returns as the next segment's window (spec/armt_published.md 4.6-4.7).

The cell also runs several layers at once (a grouped diagonal step): every input then carries a
leading group axis `G`, the layer and the memory weights hold the group's weights, and `dense` and
`project` multiply group g by its own layer's weights.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxlongctx.armt.config import ARMTConfig
from jaxlongctx.armt.memory import MemoryState, MemoryWeights, Project, project, read, write
from jaxlongctx.model.attention_strategies import CausalPrefill, WindowedSegment
from jaxlongctx.model.layers import DecoderLayer, Dense
from jaxlongctx.model.llama import Llama
from jaxlongctx.model.rope import rope_tables
from jaxlongctx.sharding import matmul, reshard_like

CELL_ATTENTION_CHUNK = 256  # query rows per attention block in a cell (keys: the causal prefix only)


def segment_layout(n: jnp.ndarray, cfg: ARMTConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """RoPE positions `[B, R]` and key validity `[B, R]` of segment buffers holding `n [B]` tokens."""
    i = jnp.arange(cfg.rows)
    positions = jnp.where(i < cfg.mem_start, i, n[..., None] + cfg.lead + i - cfg.mem_start)
    key_valid = (i < cfg.lead + n[..., None]) | (i >= cfg.mem_start)
    return positions, key_valid


def segment_visibility(n: jnp.ndarray, window_n: jnp.ndarray | None, cfg: ARMTConfig) -> jnp.ndarray:
    """Which keys each buffer row sees `[B, R, W + R]` (segments of `n [B]` tokens): the previous
    window's `W = S` token keys (`window_n [B]` of them real; None: no window, W = 0), then the buffer
    rows. Buffer: causal over valid rows, memory rows all-to-all with `mem_mem_mask` "all". Window:
    token a sees j >= a + `window_token_offset`, memory rows all of it (`window_mem` "all") or none, the
    sink none (spec/armt_published.md 4.6)."""
    i = jnp.arange(cfg.rows)
    is_mem = i >= cfg.mem_start
    _, key_valid = segment_layout(n, cfg)
    own = key_valid[..., None, :] & (i[None, :] <= i[:, None])  # B R R
    if cfg.mem_mem_mask == "all":
        own = own | (is_mem[:, None] & is_mem[None, :])
    if window_n is None:
        return own
    j = jnp.arange(cfg.segment_size)
    is_token = (i >= cfg.lead) & ~is_mem
    sees = is_token[:, None] & (j[None, :] >= i[:, None] - cfg.lead + cfg.window_token_offset)  # R S
    if cfg.window_mem == "all":
        sees = sees | is_mem[:, None]
    window = sees & (j < window_n[..., None])[..., None, :]  # B R S
    return jnp.concatenate([window, own], axis=-1)


def embed_segment(
    base: Llama, memory_tokens: jnp.ndarray, ids: jnp.ndarray, sink: jnp.ndarray | None = None
) -> jnp.ndarray:
    """Segment buffer `[B, R, D]`: the sink row `[1, D]` (if given), token embeddings of ids `[B, S]`,
    then the memory tokens `[M, D]`."""
    tok = base.embed_ids(ids)
    rows = lambda x: reshard_like(jnp.broadcast_to(x.astype(tok.dtype), (tok.shape[0], *x.shape)), tok)
    parts = ([] if sink is None else [rows(sink)]) + [tok, rows(memory_tokens)]
    return jnp.concatenate(parts, axis=1)


def cell(
    cfg: ARMTConfig,
    inv_freq: np.ndarray,
    layer: DecoderLayer,
    weights: MemoryWeights,
    h: jnp.ndarray,
    mem: MemoryState,
    n: jnp.ndarray,
    first: jnp.ndarray,
    dense: Dense = matmul,
    proj: Project = project,
) -> tuple[jnp.ndarray, MemoryState]:
    """Segment buffers `h [B, R, D]` through one layer with its memory weights and its memory state
    `mem` (one layer's: A `[B, dk, c]`, z `[B, dk]`, window `[B, S, K, hd]` x2 and `[B]` or None);
    `n [B]` tokens per row, `first [B]`. Returns the layer output and the layer's updated state."""
    a0 = jnp.where(first[..., None, None], 0, mem.A).astype(mem.A.dtype)
    z0 = jnp.where(first[..., None], 0, mem.z).astype(mem.z.dtype)
    h = read(h, weights, a0, z0, cfg, proj)
    positions, key_valid = segment_layout(n, cfg)
    cos, sin = rope_tables(positions, inv_freq)
    if cfg.plain_mask:
        h, _ = layer(h, cos, sin, CausalPrefill(key_valid, chunk=CELL_ATTENTION_CHUNK), dense)
    else:
        window_n = None if mem.wn is None else jnp.where(first, 0, mem.wn)
        visible = segment_visibility(n, window_n, cfg)
        h, (k, v) = layer(h, cos, sin, WindowedSegment(visible, mem.wk, mem.wv), dense)
    a1, z1 = write(h[..., cfg.mem_start :, :], weights, a0, z0, first, cfg, proj)
    writes = n > 0
    out = MemoryState(jnp.where(writes[..., None, None], a1, mem.A), jnp.where(writes[..., None], z1, mem.z))
    if mem.wk is not None:  # this segment's token keys and values become the next one's window
        tokens = slice(cfg.lead, cfg.mem_start)
        keep = writes[..., None, None, None]
        out = out._replace(
            wk=jnp.where(keep, k[..., tokens, :, :].astype(mem.wk.dtype), mem.wk),
            wv=jnp.where(keep, v[..., tokens, :, :].astype(mem.wv.dtype), mem.wv),
            wn=jnp.where(writes, n, mem.wn),
        )
    return h, out
