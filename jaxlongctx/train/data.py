"""Deterministic numpy batches over a token stream: batch `i` is a pure function of (seed, i).

Because a batch depends only on its step index, resuming at step `i` needs no pipeline state.
Every window is `<bos>` followed by `context` consecutive stream tokens; inputs are the first
`context` tokens of the window and targets the last `context`.
"""

from __future__ import annotations

import numpy as np

from jaxlongctx.data.tokenizer import BOS_ID, PAD_ID


def _window_starts(num_tokens: int, context: int) -> np.ndarray:
    """Start offsets of the non-overlapping `context`-token chunks of a stream (a short tail is kept)."""
    return np.arange(0, num_tokens, context, dtype=np.int64)


def _windows(tokens: np.ndarray, starts: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """`<bos>` + up to `context` tokens from each start, padded -> ids `[N, context+1]`, mask `[N, context+1]`."""
    ids = np.full((starts.size, context + 1), PAD_ID, np.int32)
    mask = np.zeros((starts.size, context + 1), bool)
    ids[:, 0], mask[:, 0] = BOS_ID, True
    for row, s in enumerate(starts):
        chunk = tokens[s : s + context]
        ids[row, 1 : 1 + chunk.size] = chunk
        mask[row, 1 : 1 + chunk.size] = True
    return ids, mask


class TokenWindows:
    """Shuffled training batches `{"ids", "mask"}` of shape `[B, context+1]` from a token stream."""

    def __init__(self, tokens: np.ndarray, batch_size: int, context: int, seed: int = 0):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}"
            )
        if batch_size < 1 or context < 1:
            raise ValueError(f"batch_size and context must be >= 1, got {batch_size} and {context}")
        if tokens.size < context:
            raise ValueError(f"token stream of {tokens.size} tokens is shorter than one context of {context}")
        self.tokens, self.batch_size, self.context, self.seed = tokens, batch_size, context, seed
        self.starts = _window_starts(tokens.size - context + 1, context)  # full windows only

    @property
    def num_windows(self) -> int:
        """Windows per epoch."""
        return int(self.starts.size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The window permutation of `epoch` (seeded by (seed, epoch))."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """Batch number `step` (0-based): ids and mask `[B, context+1]`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = self.num_windows
        sample = step * self.batch_size + np.arange(self.batch_size)
        epochs, within = np.divmod(sample, n)
        orders = {int(e): self.epoch_order(int(e)) for e in np.unique(epochs)}
        picks = np.array([orders[int(e)][i] for e, i in zip(epochs, within)])
        ids, mask = _windows(self.tokens, self.starts[picks], self.context)
        return {"ids": ids, "mask": mask}


def eval_windows(tokens: np.ndarray, context: int) -> dict[str, np.ndarray]:
    """Every stream token exactly once as a target: ids and mask `[N, context+1]` in stream order."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"tokens must be a non-empty 1-D array, got shape {tokens.shape}")
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    ids, mask = _windows(tokens, _window_starts(tokens.size, context), context)
    return {"ids": ids, "mask": mask}
