"""Sentence-aligned segmentation: segment starts that keep each sentence within one segment.

On the fixed grid a segment boundary can fall inside a sentence ("... the blue box is 47" | "11."),
so the binding it states spans two segments and the memory must join them. `SentenceSegmenter`
instead starts each segment after the last sentence end that fits: a segment holds whole sentences,
at least `min_fill * S` tokens of them, and a sentence that would leave it emptier (or is longer than
a segment) is cut where the segment is full. A sentence ends at a token ending in ".", "!" or "?"
followed by whitespace, or at a line break. Cutting is greedy from the left, so the starts of a
prefix that ends at a segment start are the whole row's starts before it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SENTENCE_END = (".", "!", "?")
SEGMENTATIONS = ("fixed", "sentences")  # how ARMT cuts rows into segments: every S tokens, or after sentences


class SentenceSegmenter:
    """Segment starts for rows of token ids, from `tokenizer`'s vocabulary (a `tokenizers.Tokenizer`)."""

    def __init__(self, tokenizer: Any, min_fill: float = 0.5):
        if tokenizer is None:
            raise ValueError("sentence segmentation needs the model's tokenizer (this model has none)")
        if not 0.0 < min_fill <= 1.0:
            raise ValueError(f"min_fill must be in (0, 1], got {min_fill}")
        texts = [tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size())]
        self.line_break = np.array([t.endswith("\n") for t in texts])  # [V]
        self.sentence_end = np.array([t.rstrip(" ").endswith(SENTENCE_END) for t in texts]) | self.line_break
        self.starts_with_space = np.array([t[:1].isspace() for t in texts])
        self.min_fill = min_fill

    def may_start(self, row: np.ndarray) -> np.ndarray:
        """`[T]` bool: a segment may start at token i (token i - 1 ends a sentence)."""
        row = np.asarray(row)
        ok = np.zeros(len(row), bool)
        prev, cur = row[:-1], row[1:]
        ok[1:] = self.sentence_end[prev] & (self.starts_with_space[cur] | self.line_break[prev])
        return ok

    def row_starts(self, ids: np.ndarray, lengths: np.ndarray, segment_size: int) -> list[np.ndarray]:
        """`starts` of each left-aligned row of `ids [B, T]` with `lengths [B]` (a row of 0 tokens: none)."""
        return [self.starts(row[:n], segment_size) if n else np.zeros(0, np.int64) for row, n in zip(ids, lengths)]

    def starts(self, row: np.ndarray, segment_size: int) -> np.ndarray:
        """Segment starts `[nS]` for the tokens `row [T]` (T >= 1): 0, then greedily the last allowed
        start within a segment's reach (no nearer than `min_fill * S`), else a full segment."""
        ok, t, p, out = self.may_start(row), len(row), 0, []
        nearest = max(1, int(segment_size * self.min_fill))
        while p < t:
            out.append(p)
            if t - p <= segment_size:
                break
            allowed = np.flatnonzero(ok[p + nearest:p + segment_size + 1])
            p = p + nearest + allowed[-1] if len(allowed) else p + segment_size
        return np.asarray(out, np.int64)


def make_segmenter(segmentation: str, tokenizer: Any) -> SentenceSegmenter | None:
    """The segmenter of `segmentation` (one of SEGMENTATIONS): None for the fixed grid."""
    if segmentation not in SEGMENTATIONS:
        raise ValueError(f"segmentation must be one of {SEGMENTATIONS}, got {segmentation!r}")
    return None if segmentation == "fixed" else SentenceSegmenter(tokenizer)
