"""Causal prefill attention on CPU: a C++ XLA FFI kernel (flash-style, register-blocked).

XLA's flash-style prefill attention (`jaxlongctx.model.attention.causal_prefill_attention`) runs each
score tile through separate dots, masks and passes over memory, at about a third of the CPU's FLOP rate
at 2K tokens. `prefill_attention_cpu.cc` packs each kv head's keys and values once, then scores tiles of
queries x keys with register-blocked products and applies the online softmax and the weighted values
while the tile is in cache. It is built on first use (`pallas_kernels.native_build`);
`native_kernel_error()` says why when it cannot be.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import native_build

SOURCE = Path(__file__).with_name("prefill_attention_cpu.cc")
TARGET = "jaxlongctx_prefill_attention"


@functools.cache
def native_kernel_error() -> str | None:
    """Build and register the CPU kernel once per process; None on success, else why it is unavailable."""
    return native_build.build_and_register(SOURCE, "PrefillAttention", TARGET)


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array) -> jax.Array:
    """Causal attention where query t sits at slot t and sees the valid slots `<= t` (inference only: no
    gradient).

    q `[B, T, H, hd]`, k/v `[B, T, K, hd]`, key_valid `[B, T]` -> `[B, T, H, hd]` in q's dtype; the same
    result as `causal_prefill_attention` for every query that sees a key (one that sees none gets 0).
    A bf16 q rounds the softmax weights to bf16 before the values, as XLA's bf16 path does.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"prefill_attention: the native CPU kernel is unavailable: {error}")
    b, t, h, hd = q.shape
    kv = k.shape[2]
    if k.shape != (b, t, kv, hd) or v.shape != k.shape or h % kv or key_valid.shape != (b, t):
        raise ValueError(
            f"prefill_attention: q {q.shape}, k {k.shape}, v {v.shape}, key_valid {key_valid.shape}"
        )
    qg = q.astype(jnp.float32).reshape(b, t, kv, h // kv, hd) * hd**-0.5  # B T K G hd
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(qg.shape, jnp.float32), vmap_method="sequential")
    out = call(
        qg,
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        key_valid.astype(bool),
        round_bf16=bool(v.dtype == jnp.bfloat16),
    )
    return out.reshape(b, t, h, hd).astype(q.dtype)
