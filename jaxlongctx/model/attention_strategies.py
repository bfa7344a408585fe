"""Attention strategies: how a decoder layer attends in each schedule (the `attend` of `DecoderLayer`).

A strategy is called with the layer's post-RoPE q `[B, T, H, hd]` and k/v `[B, T, K, hd]` of the
tokens in flight and returns the attention output `[B, T, H, hd]` and an aux value that the layer
hands back to its caller (None, the K/V to collect, or the layer's updated cache). The attention math
lives in `jaxlongctx.model.attention` and `pallas_kernels`, the cache updates in `jaxlongctx.kvcache`;
a strategy only adapts them to the layer.

- `CausalPrefill`: causal attention among the tokens of the call (dense forward, perplexity, ARMT
  segments), optionally collecting K/V to fill a cache.
- `WindowedSegment`: an ARMT segment over its own rows and a previous window, with an explicit mask
  (the published ARMT cell).
- `SlotAttention`: queries at given slots over the call's own keys (ARMT's decoding window).
- `CachedDecode`: one new token over a static dense cache plus its own K/V (dense decode).
- `PromptChunk`: a chunk of a prompt over the prompt's keys so far and its own (chunked prefill).
- `SlotWriteDecode`: new tokens written into their rows' cache slots, then attention over the cache
  (ARMT decode step).
- `PQDecode`: one new token over a PQ-coded cache and its exact window (MILLION decode).
- `KVTransformed`: another strategy run on transformed K/V (perplexity under K/V quantization).
- `RecentExactKV`: causal attention reading the recent keys exact and the older ones transformed
  (perplexity under K/V quantization with an exact recent window).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxlongctx.kvcache.exact_window import recent_exact_attention
from jaxlongctx.kvcache.pq_cache import write_window
from jaxlongctx.model.attention import (
    PREFILL_QUERY_BLOCK,
    attention,
    causal_prefill_attention,
    decode_attention,
    masked_attention,
)
from jaxlongctx.model.layers import Attend
from jaxlongctx.sharding import sharded_pq_decode_attention
from pallas_kernels.decode_attention_cpu import cached_decode_attention
from pallas_kernels.prefill_attention_cpu import prefill_attention

KVPair = tuple[jnp.ndarray, jnp.ndarray]  # keys and values (or their caches) of one layer
KVMap = Callable[[jnp.ndarray, jnp.ndarray], KVPair]  # post-RoPE (k, v) -> transformed (k, v)


@dataclasses.dataclass(frozen=True)
class CausalPrefill:
    """Causal attention where query t sits at slot t and sees the valid slots `<= t`.

    q `[..., B, T, H, hd]`, k/v `[..., B, T, K, hd]`, key_valid `[..., B, T]`: leading axes before `B`
    (a grouped ARMT step's `G`) are folded into the batch. `chunk` queries per flash-style block (see
    `causal_prefill_attention`). aux: the k/v if `collect_kv` (to fill a cache), else None. `native`
    (inference on CPU, no leading axes before `B`): the C++ kernel `pallas_kernels.prefill_attention_cpu`.
    """

    key_valid: jnp.ndarray
    collect_kv: bool = False
    chunk: int = PREFILL_QUERY_BLOCK
    native: bool = False

    def __call__(self, q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray) -> tuple[jnp.ndarray, Any]:
        lead = q.shape[:-3]
        if self.native and len(lead) == 1:
            out = prefill_attention(q, k, v, self.key_valid)
        elif len(lead) == 1:
            out = causal_prefill_attention(q, k, v, self.key_valid, chunk=self.chunk)
        else:
            rows = lambda x, tail: x.reshape(-1, *x.shape[-tail:])
            out = causal_prefill_attention(
                rows(q, 3), rows(k, 3), rows(v, 3), rows(self.key_valid, 1), chunk=self.chunk
            )
            out = out.reshape(*lead, *out.shape[1:])
        return out, ((k, v) if self.collect_kv else None)


@dataclasses.dataclass(frozen=True)
class WindowedSegment:
    """Attention of a segment's rows over `[window keys; its own keys]` where query t sees key s iff
    `visible[..., t, s]`: window_k/v `[..., B, W, K, hd]` (None: no window, W = 0), q `[..., B, T, H, hd]`,
    k/v `[..., B, T, K, hd]`, visible `[..., B, T, W + T]`; leading axes before `B` are folded into the
    batch. aux: the segment's own post-RoPE k/v."""

    visible: jnp.ndarray
    window_k: jnp.ndarray | None = None
    window_v: jnp.ndarray | None = None

    def __call__(self, q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray) -> tuple[jnp.ndarray, KVPair]:
        keys, values = k, v
        if self.window_k is not None:
            keys = jnp.concatenate([self.window_k.astype(k.dtype), k], axis=-3)
            values = jnp.concatenate([self.window_v.astype(v.dtype), v], axis=-3)
        rows = lambda x, tail: x.reshape(-1, *x.shape[-tail:])
        out = masked_attention(rows(q, 3), rows(keys, 3), rows(values, 3), rows(self.visible, 2))
        return out.reshape(q.shape), (k, v)


@dataclasses.dataclass(frozen=True)
class SlotAttention:
    """Queries at slots `q_slot [B, T]` over the call's own keys: query t sees slot s iff
    `key_valid[b, s]` and `s <= q_slot[b, t]`. aux: the k/v `[B, T, K, hd]` if `collect_kv`, else None."""

    q_slot: jnp.ndarray
    key_valid: jnp.ndarray
    collect_kv: bool = False

    def __call__(self, q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray) -> tuple[jnp.ndarray, Any]:
        return attention(q, k, v, self.q_slot, self.key_valid), ((k, v) if self.collect_kv else None)


@dataclasses.dataclass(frozen=True)
class CachedDecode:
    """One new token per row (q `[B, 1, H, hd]`) over one layer's static cache `cache_k/v [B, K, S, hd]`
    (the slots in `visible [B, S]`) and over its own k/v, which the cache does not hold yet. With
    `layer` set, cache_k/v are the whole stacked caches `[L, B, K, S, hd]` and layer `layer`'s slots
    are read in place by the CPU kernel (`pallas_kernels.decode_attention_cpu`).

    aux: the new k/v in the cache's layout and dtype `[B, K, 1, hd]`, for the caller to write into the
    cache after the layer scan (no layer writes into its slice).
    """

    cache_k: jnp.ndarray
    cache_v: jnp.ndarray
    visible: jnp.ndarray
    layer: jnp.ndarray | None = None

    def __call__(self, q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray) -> tuple[jnp.ndarray, KVPair]:
        if self.layer is None:
            out = decode_attention(q, self.cache_k, self.cache_v, k, v, self.visible)
        else:
            out = cached_decode_attention(q, self.cache_k, self.cache_v, self.visible, self.layer, k, v)
        return out, tuple(x.swapaxes(1, 2).astype(self.cache_k.dtype) for x in (k, v))


@dataclasses.dataclass(frozen=True)
class PromptChunk:
    """A chunk of a prompt's tokens, at slots `start + t` (q `[B, C, H, hd]`), written into one layer's
    prompt buffer `prompt_k/v [B, S, K, hd]` (which holds the prompt's earlier slots), then attending
    causally over the buffer's slots in `key_valid [B, S]`. aux: the chunk's k/v `[B, C, K, hd]` in the
    buffer's dtype (for the caller to write after the layer scan) and its queries at the chunk slots
    `observe [W]` `[B, W, H, hd]` (what `ObservingPrefill` collects)."""

    prompt_k: jnp.ndarray
    prompt_v: jnp.ndarray
    start: jnp.ndarray
    key_valid: jnp.ndarray
    observe: jnp.ndarray

    def __call__(self, q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray) -> tuple[jnp.ndarray, Any]:
        k, v = k.astype(self.prompt_k.dtype), v.astype(self.prompt_v.dtype)
        keys, values = (
            jax.lax.dynamic_update_slice_in_dim(buf, new, self.start, axis=1)
            for buf, new in ((self.prompt_k, k), (self.prompt_v, v))
        )
        out = causal_prefill_attention(q, keys, values, self.key_valid, offset=self.start)
        return out, (k, v, jnp.take(q, self.observe, axis=1))


@dataclasses.dataclass(frozen=True)
class SlotWriteDecode:
    """One new token per row written into one layer's cache `cache_k/v [B, K, S, hd]` at the slot
    marked in `slot_hit [B, S]` (selected, not scattered, so rows may be split over devices), then
    attending from that slot, `slot [B]`, over the cache slots in `key_valid [B, S]` up to it.
    aux: the updated cache."""

    cache_k: jnp.ndarray
    cache_v: jnp.ndarray
    slot_hit: jnp.ndarray
    slot: jnp.ndarray
    key_valid: jnp.ndarray

    def __call__(self, q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray) -> tuple[jnp.ndarray, KVPair]:
        ck, cv = (
            jnp.where(self.slot_hit[:, None, :, None], new.swapaxes(1, 2).astype(cache.dtype), cache)
            for new, cache in ((k, self.cache_k), (v, self.cache_v))
        )
        return attention(q, ck, cv, self.slot[:, None], self.key_valid, heads_major=True), (ck, cv)


@dataclasses.dataclass(frozen=True)
class PQDecode:
    """One new token per row over one layer of a PQ cache (MILLION).

    Its k/v go into the exact window `k_window/v_window [B, K, R, hd]` at slot `at [B]`; then
    `pallas_kernels.pq_decode_attention` (per shard on a mesh, `backend` as there) attends over the
    coded tokens `k_codes/v_codes [B, K, T, M]` (the first `lengths [B]` valid; centroids
    `k_cent/v_cent [(K,) M, C, ds]`) and the window slots `<= at`. aux: the updated windows. With
    `layer` set, k_codes/v_codes are every layer's `[L, B, K, T, M]` and layer `layer`'s are attended
    (read in place by the CPU kernel).
    """

    k_codes: jnp.ndarray
    v_codes: jnp.ndarray
    k_cent: jnp.ndarray
    v_cent: jnp.ndarray
    lengths: jnp.ndarray
    k_window: jnp.ndarray
    v_window: jnp.ndarray
    at: jnp.ndarray
    backend: str = "auto"
    layer: jnp.ndarray | None = None

    def __call__(self, q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray) -> tuple[jnp.ndarray, KVPair]:
        k_win, v_win = (
            write_window(self.k_window, k[:, 0], self.at),
            write_window(self.v_window, v[:, 0], self.at),
        )
        out = sharded_pq_decode_attention(
            q[:, 0],
            self.k_codes,
            self.v_codes,
            self.k_cent,
            self.v_cent,
            self.lengths,
            k_win,
            v_win,
            self.at + 1,
            q.shape[-1] ** -0.5,
            backend=self.backend,
            layer=self.layer,
        )  # [B H hd]
        return out[:, None], (k_win, v_win)


@dataclasses.dataclass(frozen=True)
class KVTransformed:
    """`attend` run on `transform(k, v)` (post-RoPE k/v `[B, T, K, hd]`), e.g. fake quantization."""

    attend: Attend
    transform: KVMap

    def __call__(self, q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray) -> tuple[jnp.ndarray, Any]:
        k, v = self.transform(k, v)
        return self.attend(q, k, v)


@dataclasses.dataclass(frozen=True)
class RecentExactKV:
    """Causal attention where query t reads key slots `t - recent < s <= t` exactly and the older ones
    through `transform(k, v)`: what decoding over a quantized cache with an exact recent window sees
    (`jaxlongctx.kvcache.exact_window`). key_valid `[B, T]`; aux: None."""

    key_valid: jnp.ndarray
    transform: KVMap
    recent: int

    def __call__(self, q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray) -> tuple[jnp.ndarray, None]:
        k_quant, v_quant = self.transform(k, v)
        return recent_exact_attention(q, k, v, k_quant, v_quant, self.key_valid, self.recent), None
