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
        return [
            self.starts(row[:n], segment_size) if n else np.zeros(0, np.int64) for row, n in zip(ids, lengths)
        ]

    def starts(self, row: np.ndarray, segment_size: int) -> np.ndarray:
        """Segment starts `[nS]` for the tokens `row [T]` (T >= 1): 0, then greedily the last allowed
        start within a segment's reach (no nearer than `min_fill * S`), else a full segment."""
        ok, t, p, out = self.may_start(row), len(row), 0, []
        while p < t:
            out.append(p)
            if t - p <= segment_size:
                break
            p += self._next_cut(ok[p : p + segment_size + 1], segment_size)
        return np.asarray(out, np.int64)

    def first_segment_length(self, tokens: np.ndarray, segment_size: int, final: bool) -> int:
        """Tokens of the first segment `starts` cuts from `tokens [T]`, as soon as they decide it: its
        cut needs S + 1 tokens (the next token says whether a sentence ended), unless `final` (the
        tokens end the row). 0 while undecided or empty. Streaming cuts with it, token by token."""
        if len(tokens) > segment_size:
            return self._next_cut(self.may_start(tokens[: segment_size + 1]), segment_size)
        return len(tokens) if final else 0

    def _next_cut(self, ok: np.ndarray, segment_size: int) -> int:
        """Length of a segment whose tokens' `may_start` flags are `ok [S + 1]` (the segment and the
        token after it): up to the last allowed start from `min_fill * S` on, else S."""
        nearest = max(1, int(segment_size * self.min_fill))
        allowed = np.flatnonzero(ok[nearest : segment_size + 1])
        return nearest + int(allowed[-1]) if len(allowed) else segment_size


def make_segmenter(segmentation: str, tokenizer: Any) -> SentenceSegmenter | None:
    """The segmenter of `segmentation` (one of SEGMENTATIONS): None for the fixed grid."""
    if segmentation not in SEGMENTATIONS:
        raise ValueError(f"segmentation must be one of {SEGMENTATIONS}, got {segmentation!r}")
    return None if segmentation == "fixed" else SentenceSegmenter(tokenizer)
