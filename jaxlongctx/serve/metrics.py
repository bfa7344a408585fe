"""Counters of a serving engine for the metrics endpoint: requests, generated tokens and their rate,
batch occupancy (busy slots per decode step), queue depth, time spent prefilling and decoding."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

RATE_WINDOW_S = 10.0  # tokens/s is measured over the last this many seconds


class Metrics:
    """Thread-safe counters; the engine's thread counts steps and tokens, the HTTP layer requests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.requests = {"received": 0, "rejected": 0, "finished": 0, "cancelled": 0, "failed": 0}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.steps = 0
        self.busy_slot_steps = 0
        self.prefill_s = 0.0  # engine time spent prefilling prompts
        self.decode_s = 0.0  # engine time spent in decode steps
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to request counter `name`."""
        with self._lock:
            self.requests[name] += n

    def admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def prefilled(self, seconds: float) -> None:
        """Time spent prefilling (a prompt or a chunk of one)."""
        with self._lock:
            self.prefill_s += seconds

    def stepped(self, busy: int, tokens: int, seconds: float = 0.0) -> None:
        """One decode step of `seconds` with `busy` occupied slots that produced `tokens` tokens."""
        now = time.monotonic()
        with self._lock:
            self.decode_s += seconds
            self.steps += 1
            self.busy_slot_steps += busy
            self.generated_tokens += tokens
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def snapshot(self, slots: int, busy: int, queued: int) -> dict[str, Any]:
        """The counters with the engine's current state, as JSON-ready values."""
        now = time.monotonic()
        with self._lock:
            recent = [n for t, n in self._recent if t >= now - RATE_WINDOW_S]
            span = min(RATE_WINDOW_S, now - self.started)
            return {
                "requests": dict(self.requests),
                "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens,
                "tokens_per_s": sum(recent) / span if span > 0 else 0.0,
                "decode_steps": self.steps,
                "busy_slot_steps": self.busy_slot_steps,
                "prefill_s": self.prefill_s,
                "decode_s": self.decode_s,
                "batch_slots": slots,
                "busy_slots": busy,
                "mean_batch_occupancy": self.busy_slot_steps / (self.steps * slots) if self.steps else 0.0,
                "queue_depth": queued,
                "uptime_s": now - self.started,
            }
