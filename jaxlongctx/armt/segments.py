"""Host-side segmentation: padded rows -> left-aligned segments with per-row token counts, cut on a
fixed grid of `segment_size` tokens (`segment`) or at given segment starts (`segment_at`)."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxlongctx.sharding import put_batch

FULL_CHUNK = 8  # segments per compiled chunk; the remainder runs one segment per call


class Segments(NamedTuple):
    """A batch of segment rows: ids `[nS, B, S]`, tokens per row `n [nS, B]`, first-of-document
    flags `first [nS, B]` (numpy or jax arrays)."""

    ids: np.ndarray
    n: np.ndarray
    first: np.ndarray

    def __getitem__(self, item):  # slice along the segment axis
        if isinstance(item, int):
            return tuple.__getitem__(self, item)
        return Segments(self.ids[item], self.n[item], self.first[item])

    def place(self, mesh: Mesh | None) -> Segments:
        """Device arrays, on `mesh` with the batch axis split over dp (see `put_batch`) when given."""
        return Segments(*(put_batch(x, mesh, axis=1) for x in self))

    @property
    def count(self) -> int:
        """Number of segments nS."""
        return self.ids.shape[0]


def compact(ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Move each row's real tokens to the front: returns ids `[B, T]`, lengths `[B]` and the
    permutation `[B, T]` (compacted index -> original index)."""
    order = np.argsort(~mask, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1), mask.sum(axis=1).astype(np.int32), order


def grid_starts(lengths: np.ndarray, segment_size: int) -> list[np.ndarray]:
    """Each row's segment starts `[nS_b]` on the fixed grid, for rows of `lengths [B]` tokens (0 -> none)."""
    return [np.arange(0, n, segment_size) for n in lengths]


def segment(ids: np.ndarray, lengths: np.ndarray, segment_size: int) -> Segments:
    """Cut left-aligned rows `ids [B, T]` with `lengths [B]` into segments of `segment_size` tokens."""
    b, t = ids.shape
    count = max(1, -(-int(lengths.max()) // segment_size))
    padded = np.zeros((b, count * segment_size), np.int32)
    padded[:, :t] = ids[:, : count * segment_size]
    seg_ids = padded.reshape(b, count, segment_size).transpose(1, 0, 2)
    n = np.clip(lengths[None, :] - segment_size * np.arange(count)[:, None], 0, segment_size).astype(np.int32)
    first = (np.arange(count)[:, None] == 0) & (n > 0)
    return Segments(np.ascontiguousarray(seg_ids), n, first)


def chunk_sizes(count: int, chunk: int = FULL_CHUNK) -> list[int]:
    """Split `count` into chunks of `chunk`, then ones: two compiled sizes whatever the length."""
    return [chunk] * (count // chunk) + [1] * (count % chunk)


def segment_at(
    ids: np.ndarray, lengths: np.ndarray, starts: list[np.ndarray], segment_size: int
) -> tuple[Segments, np.ndarray]:
    """Cut left-aligned rows `ids [B, T]` with `lengths [B]` into segments that begin at each row's
    `starts` (ascending, from 0, at most `segment_size` apart and from the row's end). Returns the
    segments (rows with fewer segments get empty ones, n = 0, at the end) and every token's slot
    `[B, T]` in a row's flattened segments `[nS * S]` (-1 past its length)."""
    b, t = ids.shape
    count = max(1, max(len(s) for s in starts))
    seg_ids = np.zeros((count, b, segment_size), np.int32)
    n = np.zeros((count, b), np.int32)
    slots = np.full((b, t), -1, np.int64)
    for r, (row_starts, length) in enumerate(zip(starts, lengths)):
        ends = np.append(row_starts[1:], length)
        if (len(row_starts) > 0) != (length > 0) or (
            len(row_starts)
            and (
                row_starts[0] != 0
                or np.any(ends - row_starts < 1)
                or np.any(ends - row_starts > segment_size)
            )
        ):
            raise ValueError(
                f"row {r}: segment starts {row_starts.tolist()} do not cut {length} tokens into "
                f"segments of 1..{segment_size}"
            )
        for j, (a, e) in enumerate(zip(row_starts, ends)):
            seg_ids[j, r, : e - a] = ids[r, a:e]
            n[j, r] = e - a
            slots[r, a:e] = j * segment_size + np.arange(e - a)
    first = (np.arange(count)[:, None] == 0) & (n > 0)
    return Segments(seg_ids, n, first), slots


def pad_segments(segs: Segments, multiple: int) -> Segments:
    """`segs` with empty segments (n = 0) appended up to a multiple of `multiple` segments, so that a
    varying segment count compiles to few shapes (slots into the flattened segments stay valid)."""
    extra = -segs.count % multiple
    if not extra:
        return segs
    pad = lambda x: np.concatenate([x, np.zeros((extra,) + x.shape[1:], x.dtype)])
    return Segments(pad(segs.ids), pad(segs.n), pad(segs.first))


def token_rows(seg_rows: jnp.ndarray, slots: np.ndarray | None, width: int) -> jnp.ndarray:
    """Per-segment rows `[nS, B, S, ...]` (logits, say) -> per-token rows `[B, width, ...]`: on the fixed
    grid (`slots` None) the first `width` of each row's flattened segments, else those at `slots [B, >=
    width]` (see `segment_at`), zeros where a slot is -1."""
    flat = jnp.swapaxes(seg_rows, 0, 1).reshape(seg_rows.shape[1], -1, *seg_rows.shape[3:])  # B nS*S ...
    if slots is None:
        return flat[:, :width]
    slots = jnp.asarray(slots)[:, :width]  # numpy, or traced inside a jitted loss
    idx = jnp.maximum(slots, 0).reshape(slots.shape + (1,) * (flat.ndim - 2))
    out = jnp.take_along_axis(flat, idx, axis=1)
    return jnp.where((slots >= 0).reshape(idx.shape), out, 0)
