"""Decode attention over one layer of a stacked dense K/V cache, read in place: a C++ XLA FFI kernel for CPU.

Inside a decode step's layer scan XLA's CPU path copies every layer's K and V slice out of the stacked
`[L, B, K, S, hd]` cache before its dots, so a long cache is read and written once more per step than
attention needs. `decode_attention_cpu.cc` reads layer `layer`'s slots where they lie, in token splits
on XLA's intra-op threads, and returns each split's normalised output and log-sum-exp; they are merged
here with the new token's own key and value (which the cache does not hold yet). It is built on first
use (`pallas_kernels.native_build`); `native_kernel_error()` says why when it cannot be.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import native_build

SOURCE = Path(__file__).with_name("decode_attention_cpu.cc")
TARGET = "jaxlongctx_decode_attention"
MAX_GROUP = 16  # query heads per kv head the kernel takes
HEAD_DIMS = (16, 32, 64, 96, 128)  # head sizes the kernel is compiled for
MIN_SPLIT_SLOTS = 512  # fewer slots per token split than this are not worth a task


@functools.cache
def native_kernel_error() -> str | None:
    """Build and register the CPU kernel once per process; None on success, else why it is unavailable."""
    return native_build.build_and_register(SOURCE, "DecodeAttention", TARGET)


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this head layout."""
    return num_heads // num_kv_heads <= MAX_GROUP and head_dim in HEAD_DIMS


def token_splits(batch: int, kv_heads: int, slots: int) -> int:
    """Token splits per (row, kv head): about two tasks per core, none under MIN_SPLIT_SLOTS slots."""
    wanted = -(-2 * (os.cpu_count() or 1) // (batch * kv_heads))
    return max(1, min(wanted, slots // MIN_SPLIT_SLOTS))


def cached_decode_attention(
    q: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    visible: jax.Array,
    layer: jax.Array | int,
    k_new: jax.Array,
    v_new: jax.Array,
) -> jax.Array:
    """One new token per row over layer `layer` of the stacked cache and over its own key/value.

    q `[B, 1, H, hd]`, cache_k/v float32 or bf16 `[L, B, K, S, hd]` (read in place), visible `[B, S]`
    (cached slots this token sees), k_new/v_new `[B, 1, K, hd]` -> `[B, 1, H, hd]` in q's dtype; the
    same result as `jaxlongctx.model.attention.decode_attention` on the layer's slices.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"cached_decode_attention: the native CPU kernel is unavailable: {error}")
    b, _, h, hd = q.shape
    kv, slots = cache_k.shape[2], cache_k.shape[3]
    if not supports(h, kv, hd):
        raise ValueError(
            f"cached_decode_attention: {h} query heads over {kv} kv heads of size {hd} not supported"
        )
    group, scale = h // kv, hd**-0.5
    qg = (q.reshape(b, kv, group, hd).astype(jnp.float32)) * scale  # B K G hd
    splits = token_splits(b, kv, slots)
    shapes = (
        jax.ShapeDtypeStruct((b, kv, splits, group, hd), jnp.float32),
        jax.ShapeDtypeStruct((b, kv, splits, group), jnp.float32),
    )
    call = jax.ffi.ffi_call(TARGET, shapes, vmap_method="sequential")
    out, lse = call(qg, cache_k, cache_v, visible.astype(bool), jnp.asarray(layer, jnp.int32))
    # the token's own key/value as one more split: its score, and its value as the split's output
    own_lse = jnp.einsum("bkgd,bkd->bkg", qg, k_new[:, 0].astype(jnp.float32))[:, :, None]  # B K 1 G
    own_out = jnp.broadcast_to(v_new[:, 0, :, None, None, :].astype(jnp.float32), (b, kv, 1, group, hd))
    out = jnp.concatenate([out, own_out], axis=2)
    lse = jnp.concatenate([lse, own_lse], axis=2)  # B K P+1 G
    weights = jax.nn.softmax(lse, axis=2)  # an empty split (-inf) weighs 0
    merged = jnp.einsum("bkpg,bkpgd->bkgd", weights, out)
    return merged.reshape(b, 1, h, hd).astype(q.dtype)
