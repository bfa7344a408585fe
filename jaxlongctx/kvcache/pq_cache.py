"""Static product-quantized KV cache (MILLION): preallocated uint8 code buffers plus an exact window.

Codes are a byte each, or two a byte for 4-bit codes (at most 16 centroids, `pallas_kernels.pq_codes`).

Per batch row b, the coded tokens are slots [0, lengths[b]) of the code buffers and the exact
(full-precision) tokens are slots [0, window_lengths[b]) of the window. The window's first
pinned[b] slots hold prompt tokens kept exact for good (attention sinks, tokens the question
attends to: `jaxlongctx.kvcache.observed_tokens`); after them come the recent tokens. New tokens go
to the window; a row whose recent part is full (R tokens) has it encoded in one batch and appended
to its codes before the next token arrives, so after every step 1..R recent tokens are exact.
Attention does not depend on the order of cached tokens (keys carry their RoPE), so pinned tokens
leave the code buffers and the codes keep the others in prompt order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxlongctx.config import ModelConfig
from jaxlongctx.kvcache.codebooks import Codebooks, cache_bytes
from jaxlongctx.kvcache.pq_codec import decode, encode
from pallas_kernels.pq_codes import is_packed, pack_codes, packs, unpack_codes

DEFAULT_WINDOW = 128  # R, the reference's full-precision recent window


class PQCache(NamedTuple):
    """Codes `[L, B, K, T, M]` uint8 (`[..., M/2]` packed 4-bit codes), exact window `[L, B, K, P + R, D]`
    (P pinned slots, R recent), valid counts per row `[B]` int32."""

    k_codes: jnp.ndarray
    v_codes: jnp.ndarray
    k_window: jnp.ndarray
    v_window: jnp.ndarray
    lengths: jnp.ndarray  # coded tokens per row
    window_lengths: jnp.ndarray  # exact tokens per row (pinned ones included), in [0, P + R]
    pinned: jnp.ndarray | None = None  # pinned prompt tokens per row, in [0, P]; None: none

    @property
    def capacity(self) -> int:
        """T, the number of code slots per row."""
        return self.k_codes.shape[3]

    @property
    def window(self) -> int:
        """P + R, the number of exact window slots per row (pinned and recent)."""
        return self.k_window.shape[3]

    def pinned_counts(self) -> jnp.ndarray:
        """Pinned prompt tokens per row `[B]` int32 (zeros for a cache without any)."""
        return jnp.zeros_like(self.lengths) if self.pinned is None else self.pinned

    @classmethod
    def partition_specs(cls, batch: str | None, heads: str | None) -> PQCache:
        """`PartitionSpec`s of a cache whose rows are split over mesh axis `batch` and kv heads over `heads`."""
        buf, rows = P(None, batch, heads, None, None), P(batch)
        return cls(buf, buf, buf, buf, rows, rows, rows)

    def nbytes(self) -> int:
        """Bytes held by the cache buffers (codebooks not included)."""
        return sum(int(x.size) * x.dtype.itemsize for x in self if x is not None)

    @classmethod
    def from_prefill(
        cls,
        k: jnp.ndarray,
        v: jnp.ndarray,
        mask: jnp.ndarray,
        k_cent: jnp.ndarray,
        v_cent: jnp.ndarray,
        capacity: int,
        window: int,
        keep_tail_exact: bool = False,
        pinned_mask: jnp.ndarray | None = None,
        pinned_slots: int = 0,
        k_weights: jnp.ndarray | None = None,
        v_weights: jnp.ndarray | None = None,
    ) -> PQCache:
        """Encode prompt keys/values `[L, B, T, K, D]` (mask `[B, T]`, pads anywhere) into a cache.

        Centroids are stacked per layer (`Codebooks.stacked()`), and so are encode weights if the
        codebooks have them (`Codebooks.stacked_weights()`). By default every prompt token is coded
        and the window (R = `window` recent slots) starts empty (the reference). With
        `keep_tail_exact` the window holds the last ((n - 1) mod R) + 1 prompt tokens of a row of n
        tokens exactly: the state a token-by-token decode through this cache would have reached.
        `pinned_mask [L or 1, B, T, K]` marks prompt tokens to keep exact for good instead of coding
        them (`observed_tokens.pinned_prompt_tokens`): at most `pinned_slots` per row, layer and kv
        head, the same count in every layer and kv head of a row; the window gets that many more slots.
        """
        num_layers, _, t, _, _ = k.shape
        if capacity < t:
            raise ValueError(f"capacity {capacity} must hold the {t} prompt slots")
        lens = mask.sum(axis=1).astype(jnp.int32)  # [B]
        order = jnp.argsort(~mask, axis=1, stable=True)  # real tokens first, in sequence order
        k = jnp.take_along_axis(k, order[None, :, :, None, None], axis=2).transpose(
            0, 1, 3, 2, 4
        )  # L B K T D
        v = jnp.take_along_axis(v, order[None, :, :, None, None], axis=2).transpose(0, 1, 3, 2, 4)
        exact = exact_tail(lens, window) if keep_tail_exact else jnp.zeros_like(lens)
        coded = lens - exact
        if pinned_mask is not None:  # pinned tokens after the coded ones, before the exact tail
            slot = jnp.arange(t)
            codable = (slot[None] < coded[:, None])[None, :, None, :]  # [1 B 1 T]
            pin = jnp.take_along_axis(pinned_mask, order[None, :, :, None], axis=2).transpose(0, 1, 3, 2)
            pin = jnp.broadcast_to(pin, (num_layers, *pin.shape[1:])) & codable  # L B K T
            rank = jnp.where(codable, pin.astype(jnp.int32), 2)
            perm = jnp.argsort(rank, axis=3, stable=True)[..., None]
            k, v = jnp.take_along_axis(k, perm, axis=3), jnp.take_along_axis(v, perm, axis=3)
            pinned = pin[0, :, 0].sum(axis=-1).astype(jnp.int32)  # [B], the same in every layer and head
            coded = coded - pinned
        else:
            pinned = jnp.zeros_like(lens)
        pad = ((0, 0), (0, 0), (0, 0), (0, capacity - t), (0, 0))
        k_codes = jnp.pad(encode_layers(k, k_cent, k_weights), pad)
        v_codes = jnp.pad(encode_layers(v, v_cent, v_weights), pad)
        size = pinned_slots + window
        idx = jnp.minimum(coded[:, None] + jnp.arange(size), t - 1)[None, :, None, :, None]  # [1 B 1 P+R 1]
        k_win = jnp.take_along_axis(k, idx, axis=3)  # L B K P+R D
        v_win = jnp.take_along_axis(v, idx, axis=3)
        return cls(k_codes, v_codes, k_win, v_win, coded, pinned + exact, pinned)


def exact_tail(lengths: jnp.ndarray, window: int) -> jnp.ndarray:
    """Prompt tokens a `keep_tail_exact` cache holds in its recent window: the last ((n - 1) mod R) + 1
    of a row of n tokens (0 for an empty row), what a token-by-token decode would have left there."""
    return jnp.where(lengths > 0, (lengths - 1) % window + 1, 0)


def encode_layers(x: jnp.ndarray, cent: jnp.ndarray, weights: jnp.ndarray | None = None) -> jnp.ndarray:
    """Encode x `[L, B, K, N, D]` with stacked centroids `[L, M, C, ds]` or `[L, K, M, C, ds]` (and
    encode weights `[L, (K,) D]`, if any) -> the cache's codes `[L, B, K, N, M]` (`[..., M/2]` when
    4-bit codes are packed)."""
    codes = jax.lax.map(lambda xcw: encode(*xcw), (x, cent, weights))  # weights None: unweighted
    return pack_codes(codes) if packs(cent.shape[-2], cent.shape[-3]) else codes


def decode_layers(codes: jnp.ndarray, cent: jnp.ndarray) -> jnp.ndarray:
    """Reconstruct the cache's codes `[L, B, K, N, M]` (or packed) with stacked centroids -> float32 `[L, B, K, N, D]`."""
    if is_packed(codes, cent):
        codes = unpack_codes(codes)
    return jax.lax.map(lambda cc: decode(cc[0], cc[1]), (codes, cent))


def flush_full_rows(
    cache: PQCache,
    k_cent: jnp.ndarray,
    v_cent: jnp.ndarray,
    k_weights: jnp.ndarray | None = None,
    v_weights: jnp.ndarray | None = None,
    *,
    recent: int | None = None,
) -> PQCache:
    """Encode the recent tokens of rows whose `recent` (R, default the whole window) recent slots are
    full (one batch, all layers) and append them to their codes; pinned slots stay.

    Every row's recent codes are written at its `lengths` offset (beyond a non-full row's valid
    codes, so harmless); only full rows advance. Needs `lengths + R <= capacity` for every row.
    """
    recent = cache.window if recent is None else recent
    pinned = cache.pinned_counts()
    full = cache.window_lengths >= pinned + recent  # [B]
    put = jax.vmap(
        lambda buf, new, off: jax.lax.dynamic_update_slice(buf, new, (0, 0, off, 0)),
        in_axes=(1, 1, 0),
        out_axes=1,
    )  # per-row offset along T of [L, B, K, T, M]
    idx = (pinned[:, None] + jnp.arange(recent))[None, :, None, :, None]  # [1 B 1 R 1]: the recent slots

    def flush(c: PQCache) -> PQCache:
        k_new = encode_layers(jnp.take_along_axis(c.k_window, idx, axis=3), k_cent, k_weights)  # L B K R M
        v_new = encode_layers(jnp.take_along_axis(c.v_window, idx, axis=3), v_cent, v_weights)
        return c._replace(
            k_codes=put(c.k_codes, k_new, c.lengths),
            v_codes=put(c.v_codes, v_new, c.lengths),
            lengths=c.lengths + jnp.where(full, recent, 0),
            window_lengths=jnp.where(full, pinned, c.window_lengths),
        )

    return jax.lax.cond(full.any(), flush, lambda c: c, cache)


def write_window(window: jnp.ndarray, new: jnp.ndarray, at: jnp.ndarray) -> jnp.ndarray:
    """Put one token's k or v `[B, K, D]` into a layer's window `[B, K, R, D]` at slot `at[b]` of each row."""
    hit = jnp.arange(window.shape[2])[None, None, :, None] == at[:, None, None, None]
    return jnp.where(hit, new[:, :, None, :].astype(window.dtype), window)


def reconstruct_dense(
    cache: PQCache, k_cent: jnp.ndarray, v_cent: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """What attention sees: decoded codes then the exact window, as k/v `[L, B, T+R, K, D]` float32
    and key_valid `[B, T+R]` (coded slots < lengths, window slots < window_lengths)."""
    k = jnp.concatenate([decode_layers(cache.k_codes, k_cent), cache.k_window.astype(jnp.float32)], axis=3)
    v = jnp.concatenate([decode_layers(cache.v_codes, v_cent), cache.v_window.astype(jnp.float32)], axis=3)
    valid = jnp.concatenate(
        [
            jnp.arange(cache.capacity)[None] < cache.lengths[:, None],
            jnp.arange(cache.window)[None] < cache.window_lengths[:, None],
        ],
        axis=1,
    )
    return k.transpose(0, 1, 3, 2, 4), v.transpose(0, 1, 3, 2, 4), valid


def pq_cache_report(
    config: ModelConfig, codebooks: Codebooks, tokens: int, window: int = DEFAULT_WINDOW, batch: int = 1
) -> dict[str, int | float]:
    """Exact bytes of a PQ cache holding `tokens` tokens per row (codes, bf16 window, codebooks) vs dense bf16."""
    if (codebooks.num_layers, codebooks.num_kv_heads, codebooks.head_dim) != (
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
    ):
        raise ValueError(
            f"codebooks are for L={codebooks.num_layers}, K={codebooks.num_kv_heads}, D={codebooks.head_dim}; "
            f"the model has L={config.num_layers}, K={config.num_kv_heads}, D={config.head_dim}"
        )
    report = cache_bytes(
        tokens,
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        codebooks.ds,
        codebooks.bits,
        window,
        granularity=codebooks.granularity,
        batch=batch,
    )
    return {
        "tokens": tokens,
        "batch": batch,
        "window": window,
        "ds": codebooks.ds,
        "bits": codebooks.bits,
        "granularity": codebooks.granularity,
        **report,
    }
