"""Sampling settings (`SamplingParams`) and next-token selection: greedy, temperature, top-k and top-p."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlongctx.config import eos_ids
from jaxlongctx.validation import check_positive_int

# Below this, logits / temperature overflows float32 and sampling degenerates (every id 0).
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one `generate` call; checked on construction (clear ValueErrors).

    `temperature` 0 is greedy; `top_k` / `top_p` restrict sampling; `seed` makes it repeatable.
    `stop_ids`: ids that end a row (which then fills with the first of them); None means the model
    config's eos ids (for chat models, add the tokenizer's end-of-turn ids: `jaxlongctx.chat.stop_ids`),
    () never stops early.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_positive_int(self.max_new_tokens, "max_new_tokens")
        t = self.temperature
        number = not isinstance(t, bool) and isinstance(t, (int, float)) and math.isfinite(t)
        if not number or not (t == 0 or t >= MIN_TEMPERATURE):
            raise ValueError(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                f"got {self.temperature!r}"
            )
        if self.top_k is not None:
            object.__setattr__(self, "top_k", check_positive_int(self.top_k, "top_k"))
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", None if p is None else float(p))
        object.__setattr__(self, "seed", int(self.seed))
        if self.stop_ids is not None:
            object.__setattr__(self, "stop_ids", _stop_tuple(self.stop_ids))

    @property
    def sampler(self) -> tuple[float, int | None, float | None]:
        """(temperature, top_k, top_p): the static arguments of `select_next`."""
        return self.temperature, self.top_k, self.top_p

    def resolve_stop_ids(self, model: Any) -> tuple[int, ...]:
        """The ids that end a row for `model`: `stop_ids` (checked against its vocabulary), else the
        config's eos ids."""
        if self.stop_ids is None:
            return eos_ids(model.config)
        vocab = model.config.vocab_size
        bad = [i for i in self.stop_ids if i >= vocab]
        if bad:
            raise ValueError(f"stop_ids: {bad[0]} is outside the vocabulary [0, {vocab})")
        return self.stop_ids


def _stop_tuple(stop_ids: Any) -> tuple[int, ...]:
    """`stop_ids` (an int or an iterable of ints >= 0) as a tuple without repeats."""
    values = [stop_ids] if isinstance(stop_ids, (int, np.integer)) else stop_ids
    try:
        values = list(values)
    except TypeError:
        raise ValueError(f"stop_ids must be token ids (an int or a list of ints), got {stop_ids!r}") from None
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"stop_ids must be token ids >= 0, got {v!r}")
    return tuple(dict.fromkeys(int(v) for v in values))


def select_next(
    logits: jnp.ndarray, key: jax.Array, temperature: float, top_k: int | None, top_p: float | None
) -> jnp.ndarray:
    """Pick next ids `[B]` from float32 logits `[B, V]`; temperature 0 means greedy argmax."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the best token)
        drop_sorted = (cum - jax.nn.softmax(sorted_logits, axis=-1)) >= top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
