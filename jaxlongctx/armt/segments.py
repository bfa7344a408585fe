"""Host-side segmentation: padded rows -> left-aligned segments with per-row token counts."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from jax.sharding import Mesh

from jaxlongctx.parallel import put_batch

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


def segment(ids: np.ndarray, lengths: np.ndarray, segment_size: int) -> Segments:
    """Cut left-aligned rows `ids [B, T]` with `lengths [B]` into segments of `segment_size` tokens."""
    b, t = ids.shape
    count = max(1, -(-int(lengths.max()) // segment_size))
    padded = np.zeros((b, count * segment_size), np.int32)
    padded[:, :t] = ids[:, :count * segment_size]
    seg_ids = padded.reshape(b, count, segment_size).transpose(1, 0, 2)
    n = np.clip(lengths[None, :] - segment_size * np.arange(count)[:, None], 0, segment_size).astype(np.int32)
    first = (np.arange(count)[:, None] == 0) & (n > 0)
    return Segments(np.ascontiguousarray(seg_ids), n, first)


def chunk_sizes(count: int, chunk: int = FULL_CHUNK) -> list[int]:
    """Split `count` into chunks of `chunk`, then ones: two compiled sizes whatever the length."""
    return [chunk] * (count // chunk) + [1] * (count % chunk)
