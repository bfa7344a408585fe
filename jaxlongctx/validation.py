"""Input checks at the public API boundary: clear ValueErrors instead of silent JAX behaviour."""

from __future__ import annotations

from typing import Any

import numpy as np


def check_ids(ids: Any, vocab_size: int, name: str = "ids") -> np.ndarray:
    """Token ids as an int32 `[B, T]` array; rejects floats, wrong rank, empty input and ids
    outside `[0, vocab_size)` (JAX gathers would silently clamp them)."""
    arr = np.asarray(ids)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2:
        raise ValueError(f"{name} must have shape [batch, length], got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name} must not be empty, got shape {arr.shape}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} contains token id {bad} outside the vocabulary [0, {vocab_size})")
    return arr.astype(np.int32)


def check_mask(mask: Any, ids: np.ndarray, name: str = "attention_mask") -> np.ndarray:
    """A boolean `[B, T]` padding mask matching ids (None -> all real); every row needs a real token."""
    if mask is None:
        return np.ones(ids.shape, bool)
    arr = np.asarray(mask)
    if arr.ndim == 1 and ids.shape[0] == 1:
        arr = arr[None]
    if arr.shape != ids.shape:
        raise ValueError(f"{name} has shape {arr.shape} but ids have shape {ids.shape}")
    if arr.dtype != bool:
        if not np.issubdtype(arr.dtype, np.integer) or not np.isin(arr, (0, 1)).all():
            raise ValueError(f"{name} must be boolean or 0/1 integers, got dtype {arr.dtype}")
        arr = arr.astype(bool)
    empty = np.flatnonzero(~arr.any(axis=1))
    if empty.size:
        raise ValueError(f"{name} row {int(empty[0])} has no real token")
    return arr


def check_positive_int(value: Any, name: str, *, allow_zero: bool = False) -> int:
    """An int > 0 (or >= 0 with allow_zero), else ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return int(value)


def check_text(text: str, name: str) -> str:
    """`text` if it is valid Unicode (a command-line argument in another encoding arrives with
    unpaired surrogates), else ValueError naming the argument."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid UTF-8 text") from None
    return text
