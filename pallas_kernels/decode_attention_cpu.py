"""Decode attention over one layer of a stacked dense K/V cache, read in place: a C++ XLA FFI kernel for CPU.

Inside a decode step's layer scan XLA's CPU path copies every layer's K and V slice out of the stacked
`[L, B, K, S, hd]` cache before its dots, so a long cache is read and written once more per step than
attention needs. `decode_attention_cpu.cc` reads layer `layer`'s slots where they lie, in token splits
on XLA's intra-op threads, and merges the splits with the new token's own key and value (which the
cache does not hold yet) into the attention output. It is built on first
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
    own_k, own_v = (x.reshape(b, kv, hd).astype(jnp.float32) for x in (k_new, v_new))  # B K hd
    call = jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((b, kv, group, hd), jnp.float32), vmap_method="sequential"
    )
    out = call(
        qg,
        cache_k,
        cache_v,
        visible.astype(bool),
        jnp.asarray(layer, jnp.int32),
        own_k,
        own_v,
        splits=token_splits(b, kv, slots),
    )
    return out.reshape(b, 1, h, hd).astype(q.dtype)
