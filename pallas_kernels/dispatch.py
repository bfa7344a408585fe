"""Backend selection shared by every kernel: XLA reference, Pallas GPU, or Pallas interpret."""

from __future__ import annotations

from typing import Literal

import jax

Backend = Literal["auto", "xla", "pallas", "interpret"]
BACKENDS: tuple[str, ...] = ("auto", "xla", "pallas", "interpret")


def resolve_backend(backend: str) -> Literal["xla", "pallas", "interpret"]:
    """Map a user backend string to a concrete one ("auto": pallas on GPU, xla elsewhere)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return backend  # type: ignore[return-value]


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def clamp_pow2(n: int, lo: int, hi: int) -> int:
    """Power-of-two block size covering n, clamped to [lo, hi] (both powers of two)."""
    return max(lo, min(hi, next_pow2(n)))
