"""PQ lookup-table attention over the coded tokens on CPU: a C++ XLA FFI kernel, built on first use.

XLA's CPU gather runs at about 0.5 G lookups/s here, so a decode step that scores every coded token
through a lookup table is gather-bound far below the memory bandwidth. `pq_attention_cpu.cc` does
the same arithmetic as `pq_attention._coded_partials_xla` in one pass per (row, kv head, 4 query
heads, token split): 16-byte table loads that score 4 query heads at once, an online softmax, and a
per-centroid weight histogram instead of reconstructed values. It is compiled with the C++
compiler (`$CXX`, default `g++`) against JAX's FFI headers into a per-user cache
(`$JAXLONGCTX_KERNEL_CACHE`, default `~/.cache/jaxlongctx/kernels`), keyed by the source, the
jaxlib version and the CPU (`pallas_kernels.native_build`), and registered with XLA once per
process. Without a compiler `native_kernel_error()` says why and callers keep the XLA path.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import native_build

SOURCE = Path(__file__).with_name("pq_attention_cpu.cc")
TARGET = "jaxlongctx_pq_coded_partials"
LANES = 4  # query heads per lookup-table entry (one 16-byte load)


@functools.cache
def native_kernel_error() -> str | None:
    """Build and register the CPU kernel once per process; None on success, else why it is unavailable."""
    return native_build.build_and_register(SOURCE, "PqCodedPartials", TARGET)


def native_splits(batch: int, kv_heads: int, blocks: int, length_hint: int) -> int:
    """Token splits S per (row, kv head, block): enough tasks to keep every core busy, none under 1K tokens."""
    cores = os.cpu_count() or 1
    tasks = batch * kv_heads * blocks
    wanted = -(-2 * cores // tasks)  # ceil: about two tasks per core balance uneven rows
    return max(1, min(wanted, length_hint // 1024))


def pq_coded_partials_native(
    lut: jax.Array,
    k_codes: jax.Array,
    v_codes: jax.Array,
    v_cent: jax.Array,
    lengths: jax.Array,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Coded-token partials through the CPU kernel.

    lut [B K NB M C 4] fp32 (scale folded in), codes [B K T M] uint8 (or every layer's [L B K T M] with
    `layer`, read in place), v_cent [Kc M C ds] (Kc = 1 or K), lengths [B] -> (out [B K NB S 4 D],
    lse [B K NB S 4]) fp32, one normalised partial per token split.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"pq_decode_attention: the native CPU kernel is unavailable: {error}")
    if layer is None:
        k_codes, v_codes, layer = k_codes[None], v_codes[None], 0
    batch, kv_heads, blocks, subspaces, _, _ = lut.shape
    head_dim = subspaces * v_cent.shape[-1]
    splits = native_splits(batch, kv_heads, blocks, k_codes.shape[3])
    shapes = (
        jax.ShapeDtypeStruct((batch, kv_heads, blocks, splits, LANES, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, blocks, splits, LANES), jnp.float32),
    )
    call = jax.ffi.ffi_call(TARGET, shapes, vmap_method="sequential")
    return call(
        lut.astype(jnp.float32),
        k_codes,
        v_codes,
        v_cent.astype(jnp.float32),
        lengths.astype(jnp.int32),
        jnp.asarray(layer, jnp.int32),
    )
