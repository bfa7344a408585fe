"""PQ lookup-table decode attention of one layer on CPU: a C++ XLA FFI kernel, built on first use.

XLA's CPU gather runs at about 0.5 G lookups/s here, so a decode step that scores every coded token
through a lookup table is gather-bound far below the memory bandwidth, and the step's small XLA
operations around it (lookup tables, the exact window, the merge) cost more than the attention at
short contexts. `pq_attention_cpu.cc` does the whole layer in one call: per (row, kv head, 4 query
heads, token split) it builds the lookup table and walks the coded tokens once (16-byte table loads
that score 4 query heads at once, an online softmax, a per-centroid weight histogram instead of
reconstructed values); per (row, kv head) it attends over the exact window; then it merges them by
log-sum-exp. Packed 4-bit codes (`pallas_kernels.pq_codes`) take a register path instead: a
subspace's 16-entry lookup table is one vector register, permuted by 16 tokens' codes at once, and
the values are the value centroids permuted the same way. For a bf16 model at ds 1 and 2 that path
looks keys and values up as bf16 and multiplies them in pairs (vdpbf16ps): half the instructions. It is compiled with the C++ compiler (`$CXX`, default `g++`) against JAX's FFI headers
into a per-user cache (`$JAXLONGCTX_KERNEL_CACHE`, default `~/.cache/jaxlongctx/kernels`), keyed by
the source, the jaxlib version and the CPU (`pallas_kernels.native_build`), and registered with XLA
once per process. Without a compiler `native_kernel_error()` says why and callers keep the XLA path.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import native_build

SOURCE = Path(__file__).with_name("pq_attention_cpu.cc")
TARGET = "jaxlongctx_pq_decode_attention"
LANES = 4  # query heads per lookup-table entry (one 16-byte load)


@functools.cache
def native_kernel_error() -> str | None:
    """Build and register the CPU kernel once per process; None on success, else why it is unavailable."""
    return native_build.build_and_register(SOURCE, "PqDecodeAttention", TARGET)


def bf16_register_path(sub_dim: int) -> bool:
    """Whether bf16 queries over packed codes of `sub_dim` dims are scored in bf16 here: ds 1 and 2 on a
    CPU with AVX512-BF16 (the kernel is built with -march=native); elsewhere they take the fp32 path."""
    flags = native_build.cpuinfo("flags").split()
    native = native_build.march() == "native"  # a build for another -march has that tier's paths
    return native and sub_dim in (1, 2) and "avx512_bf16" in flags and "avx512bw" in flags


def reads_packed(sub_dim: int) -> bool:
    """Whether the kernel reads packed 4-bit codes of subspaces of `sub_dim` dims (its register path)."""
    return sub_dim in (1, 2, 4)


def native_splits(batch: int, kv_heads: int, blocks: int, length_hint: int) -> int:
    """Token splits S per (row, kv head, block): enough tasks to keep every core busy, none under 1K tokens."""
    cores = os.cpu_count() or 1
    tasks = batch * kv_heads * blocks
    wanted = -(-2 * cores // tasks)  # ceil: about two tasks per core balance uneven rows
    return max(1, min(wanted, length_hint // 1024))


def pq_decode_attention_native(
    q: jax.Array,
    k_codes: jax.Array,
    v_codes: jax.Array,
    k_cent: jax.Array,
    v_cent: jax.Array,
    lengths: jax.Array,
    k_res: jax.Array,
    v_res: jax.Array,
    res_lengths: jax.Array,
    scale: float | jax.Array,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Attention over the coded tokens and the exact window through the CPU kernel, in one call.

    q [B H D], codes [B K T M] uint8 or packed [B K T M/2] (`reads_packed`), or every layer's
    [L B K T M] with `layer`, read in place;
    centroids [(K,) M C ds], lengths [B], window k_res/v_res [B K R D] (float32 or bf16), res_lengths [B]
    -> [B H D] float32; heads that see no token give 0.
    A bf16 `q` (a bf16 model's) lets packed codes at ds 1 and 2 take the bf16 register path on CPUs
    with AVX512-BF16 (`bf16_register_path`): q, the centroids and the softmax weights rounded to bf16,
    as the model's own bf16 attention rounds q, K/V and its weights, with float32 sums.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"pq_decode_attention: the native CPU kernel is unavailable: {error}")
    if layer is None:
        k_codes, v_codes, layer = k_codes[None], v_codes[None], 0
    batch, heads, head_dim = q.shape
    kv_heads = k_codes.shape[2]
    group = heads // kv_heads
    qg = (q.astype(jnp.float32) * scale).reshape(batch, kv_heads, group, head_dim)  # [B K G D]
    k_cent, v_cent = (
        c.astype(jnp.float32).reshape(-1, *c.shape[-3:]) for c in (k_cent, v_cent)
    )  # [Kc M C ds]
    if k_res.dtype not in (jnp.float32, jnp.bfloat16):
        k_res, v_res = k_res.astype(jnp.float32), v_res.astype(jnp.float32)
    splits = native_splits(batch, kv_heads, -(-group // LANES), k_codes.shape[3])
    call = jax.ffi.ffi_call(
        TARGET,
        jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), jnp.float32),
        vmap_method="sequential",
    )
    out = call(
        qg,
        k_codes,
        v_codes,
        k_cent,
        v_cent,
        lengths.astype(jnp.int32),
        k_res,
        v_res.astype(k_res.dtype),
        res_lengths.astype(jnp.int32),
        jnp.asarray(layer, jnp.int32),
        splits=splits,
        bf16_math=int(q.dtype == jnp.bfloat16),
    )
    return out.reshape(batch, heads, head_dim)
