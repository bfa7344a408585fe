"""Chunked prefill: a long prompt read a chunk at a time, so that the engine can run decode steps of
the other slots between its chunks (they keep streaming while it is read).

Each chunk attends in full precision over the prompt's keys so far, kept in a prompt buffer of the
request's own (`[L, 1, S, K, hd]`, the layout `forward_hidden` collects), and over its own keys. When
the last chunk is read, the buffer becomes the request's cache row exactly as a whole-prompt prefill's
keys would (dense: copied; PQ: encoded), so decoding goes on as after `jaxlongctx.generate`'s prefill.
The last chunk holds at least the prompt's last `OBSERVE` tokens, whose queries choose the PQ cache's
observed exact tokens (`jaxlongctx.kvcache.observed_tokens`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from jaxlongctx.kvcache.observed_tokens import OBSERVE
from jaxlongctx.model.attention_strategies import PromptChunk
from jaxlongctx.model.llama import Llama

DEFAULT_CHUNK = 512  # prompt tokens per chunk (a multiple of OBSERVE)


def check_chunk(chunk: int) -> None:
    """Raise ValueError unless `chunk` holds the OBSERVE tokens a last chunk must hold."""
    if chunk < OBSERVE:
        raise ValueError(f"the prefill chunk must be >= {OBSERVE} tokens, got {chunk}")


def chunk_plan(n: int, chunk: int) -> list[tuple[int, int]]:
    """(start, count) of each chunk of an `n`-token prompt: `chunk` tokens each, the next to last one
    shortened where the last would hold fewer than OBSERVE tokens (chunk >= OBSERVE)."""
    check_chunk(chunk)
    ends = list(range(chunk, n, chunk)) + [n]
    if len(ends) > 1 and n - ends[-2] < OBSERVE:
        ends[-2] = n - OBSERVE
    return [(start, end - start) for start, end in zip([0, *ends[:-1]], ends)]


@dataclass(eq=False)
class PromptReading:
    """A prompt being prefilled chunk by chunk: its `plan`, the chunks read so far, the prompt buffer
    (`k`, `v`, allocated by the first chunk), the last chunk's logits `[1, V]` and observed queries."""

    ids: list[int]
    plan: list[tuple[int, int]]
    done: int = 0
    k: Any = None
    v: Any = None
    logits: Any = None
    q_observed: Any = None
    started_at: float = field(default_factory=time.monotonic)

    @property
    def remaining(self) -> int:
        """Prompt tokens still to read."""
        return sum(count for _, count in self.plan[self.done :])

    @property
    def finished(self) -> bool:
        return self.done == len(self.plan)


def read_chunk(
    module: Llama,
    ids: jnp.ndarray,
    start: jnp.ndarray,
    count: jnp.ndarray,
    observe: jnp.ndarray,
    prompt_k: jnp.ndarray,
    prompt_v: jnp.ndarray,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """One chunk: ids `[1, C]` (its first `count` real) at slots `start + t`, over the prompt buffer
    `prompt_k/v [L, 1, S, K, hd]` (flash-style: key blocks past the chunk are skipped); `observe [W]`:
    chunk slots whose queries are returned. Returns the logits of the chunk's last real token
    `[1, V]`, its observed queries `[L, 1, W, H, hd]` and the buffers with the chunk written."""
    width = ids.shape[1]
    positions = start + jnp.arange(width, dtype=jnp.int32)[None]  # 1 C
    cos, sin = module.rope(positions)
    key_valid = (jnp.arange(prompt_k.shape[2]) < start + count)[None]  # 1 S

    def body(layer, h, buffers):
        k_buf, v_buf = buffers  # 1 S K hd
        return layer(h, cos, sin, PromptChunk(k_buf, v_buf, start, key_valid, observe))

    h, (k, v, q_observed) = module.scan_layers(body, module.embed_ids(ids), (prompt_k, prompt_v))
    prompt_k, prompt_v = (
        jax.lax.dynamic_update_slice(buf, new, (0, 0, start, 0, 0))
        for buf, new in ((prompt_k, k), (prompt_v, v))
    )  # k: L 1 C K hd
    last = jax.lax.dynamic_slice_in_dim(h, count - 1, 1, axis=1)  # 1 1 D
    return module.head(last)[:, 0], q_observed, prompt_k, prompt_v
