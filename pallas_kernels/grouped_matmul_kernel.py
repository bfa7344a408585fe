"""Pallas (Triton) kernel for a grouped GEMM: out[g] = op(a[g]) @ op(b[first + g]) for g < num_active."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import clamp_pow2

MIN_BLOCK = 16  # Triton's tl.dot needs every tile dimension >= 16


@dataclasses.dataclass(frozen=True)
class GemmBlocks:
    """Tile sizes (all powers of two) and launch parameters of one grouped-GEMM call."""

    rows: int  # bm: output rows per program
    cols: int  # bn: output columns per program
    depth: int  # bk: contraction slice per loop step
    num_warps: int
    num_stages: int


def choose_blocks(rows: int, cols: int, depth: int, dtype: jnp.dtype) -> GemmBlocks:
    """Default tiles for an [rows x depth] @ [depth x cols] product: pow2, >= 16, capped for registers."""
    wide = jnp.dtype(dtype).itemsize >= 4
    bm = clamp_pow2(rows, MIN_BLOCK, 64)
    bn = clamp_pow2(cols, MIN_BLOCK, 64 if wide else 128)
    bk = clamp_pow2(depth, MIN_BLOCK, 32 if wide else 64)
    num_warps = 8 if bm * bn >= 64 * 128 else 4
    return GemmBlocks(bm, bn, bk, num_warps, 3)


def _load_tile(
    ref: Any,
    layer: jax.Array,
    row0: jax.Array,
    rows: int,
    col0: jax.Array,
    cols: int,
    n_rows: int,
    n_cols: int,
    transpose: bool,
) -> jax.Array:
    """Load ref[layer, row0:row0+rows, col0:col0+cols] (zero outside), optionally transposed."""
    if transpose:  # the tile is stored [cols, rows] in memory
        return _load_tile(ref, layer, col0, cols, row0, rows, n_cols, n_rows, False).T
    r = row0 + jnp.arange(rows, dtype=jnp.int32)
    c = col0 + jnp.arange(cols, dtype=jnp.int32)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    return plgpu.load(ref.at[layer, pl.ds(row0, rows), pl.ds(col0, cols)], mask=mask, other=0)


def _gemm_kernel(
    meta_ref: Any,
    a_ref: Any,
    b_ref: Any,
    o_ref: Any,
    *,
    blocks: GemmBlocks,
    trans_a: bool,
    trans_b: bool,
    rows: int,
    cols: int,
    depth: int,
    compute_dtype: jnp.dtype,
) -> None:
    """One program: output tile (g, i, j); loops over the contraction in `blocks.depth` steps."""
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first, num_active = meta_ref[0], meta_ref[1]
    layer = jnp.minimum(first + g, b_ref.shape[0] - 1)  # never read past the weights, whatever the scalars
    bm, bn, bk = blocks.rows, blocks.cols, blocks.depth

    @pl.when(g >= num_active)
    def _skip():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(g < num_active)
    def _compute():
        def step(s, acc):  # acc [bm, bn] fp32
            k0 = s * bk
            a = _load_tile(a_ref, g, i * bm, bm, k0, bk, rows, depth, trans_a)  # [bm, bk]
            b = _load_tile(b_ref, layer, k0, bk, j * bn, bn, depth, cols, trans_b)  # [bk, bn]
            return acc + jnp.dot(
                a.astype(compute_dtype), b.astype(compute_dtype), preferred_element_type=jnp.float32
            )

        acc = jax.lax.fori_loop(0, pl.cdiv(depth, bk), step, jnp.zeros((bm, bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)


def grouped_matmul_pallas(
    a: jax.Array,
    b: jax.Array,
    first_layer: jax.Array | int,
    num_active: jax.Array | int,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
    out_dtype: jnp.dtype | None = None,
    interpret: bool = False,
    blocks: GemmBlocks | None = None,
) -> jax.Array:
    """out[g] = op(a[g]) @ op(b[first_layer + g]) for g < num_active, zero rows otherwise."""
    # a: [G, rows, depth] (or [G, depth, rows] if trans_a); b: [L, depth, cols] (or [L, cols, depth])
    num_groups = a.shape[0]
    rows, depth = (a.shape[2], a.shape[1]) if trans_a else (a.shape[1], a.shape[2])
    cols = b.shape[1] if trans_b else b.shape[2]
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    compute_dtype = jnp.promote_types(a.dtype, b.dtype)
    if blocks is None:
        blocks = choose_blocks(rows, cols, depth, compute_dtype)
    meta = jnp.stack([jnp.asarray(first_layer, jnp.int32), jnp.asarray(num_active, jnp.int32)])  # [2]
    kernel = functools.partial(
        _gemm_kernel,
        blocks=blocks,
        trans_a=trans_a,
        trans_b=trans_b,
        rows=rows,
        cols=cols,
        depth=depth,
        compute_dtype=compute_dtype,
    )
    whole = lambda x: pl.BlockSpec(x.shape, lambda g, i, j: (0,) * x.ndim)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, rows, cols), out_dtype),
        grid=(num_groups, pl.cdiv(rows, blocks.rows), pl.cdiv(cols, blocks.cols)),
        in_specs=[whole(meta), whole(a), whole(b)],
        out_specs=pl.BlockSpec((None, blocks.rows, blocks.cols), lambda g, i, j: (g, i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(meta, a, b)
