"""Pallas (Triton) split-K kernel for the coded part of PQ lookup-table decode attention."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import next_pow2

TARGET_PROGRAMS = 264  # about two programs per SM on an H100/H200 (132 SMs)
TILE_ELEMENTS = 16384  # cap on the [Gp, bt, max(M, D)] temporaries of one loop step


@dataclasses.dataclass(frozen=True)
class PQBlocks:
    """Token tiling of the coded cache: `tokens` per loop step, `tiles_per_split` steps per program."""

    tokens: int  # bt, power of two
    tiles_per_split: int
    num_splits: int  # S programs along the tokens of one (batch, kv head)
    num_warps: int


def choose_blocks(
    batch: int, kv_heads: int, group_p: int, capacity: int, head_dim: int, subspaces: int
) -> PQBlocks:
    """Default tiling: bt keeps per-step temporaries near TILE_ELEMENTS; splits fill about TARGET_PROGRAMS."""
    width = max(head_dim, subspaces)
    bt = max(16, min(128, TILE_ELEMENTS // (group_p * width)))
    num_tiles = pl.cdiv(capacity, bt)
    splits = max(1, min(num_tiles, pl.cdiv(TARGET_PROGRAMS, batch * kv_heads)))
    tiles_per_split = pl.cdiv(num_tiles, splits)
    return PQBlocks(bt, tiles_per_split, pl.cdiv(num_tiles, tiles_per_split), 4)


def _pq_kernel(
    len_ref: Any,
    lut_ref: Any,
    kc_ref: Any,
    vc_ref: Any,
    vcent_ref: Any,
    o_ref: Any,
    lse_ref: Any,
    *,
    blocks: PQBlocks,
    group_p: int,
    columns: int,
    parts: int,
    centroids: int,
    sub_dim: int,
) -> None:
    """One program: all Gp query heads of kv head k over tokens [s*span, (s+1)*span) of batch row b.

    A token's codes are `columns` bytes holding `parts` codes each (1, or 2 packed 4-bit codes): part j
    of column c is subspace `c * parts + j`. Out block `[Gp, parts, columns, ds]`, lse `[Gp]`."""
    b, s = pl.program_id(0), pl.program_id(2)
    bt = blocks.tokens
    start = s * (bt * blocks.tiles_per_split)
    length = jnp.minimum(len_ref[b], kc_ref.shape[0])  # lengths past the capacity T read nothing extra
    remaining = jnp.maximum(length - start, 0)
    num_tiles = jnp.minimum(
        (remaining + bt - 1) // bt, blocks.tiles_per_split
    )  # only tiles with a valid token

    subspaces = columns * parts
    bits = 8 // parts
    head_off = jnp.arange(group_p, dtype=jnp.int32)[:, None, None] * (subspaces * centroids)  # [Gp 1 1]
    sub = [jnp.arange(columns, dtype=jnp.int32) * parts + j for j in range(parts)]  # subspace of part j
    lut_sub_off = [m[None, None, :] * centroids for m in sub]  # [1 1 Mc] each
    cent_sub_off = [m[None, :, None] * (centroids * sub_dim) for m in sub]  # [1 Mc 1] each
    lane = jnp.arange(sub_dim, dtype=jnp.int32)[None, None, :]  # [1 1 ds]

    def part(raw, j):  # codes of part j from bytes [bt Mc] (int32)
        return raw if parts == 1 else (raw >> (bits * j)) & ((1 << bits) - 1)

    def step(it, carry):
        m_i, l_i, accs = carry  # [Gp], [Gp], parts x [Gp Mc ds]
        t0 = start + it * bt
        valid = t0 + jnp.arange(bt, dtype=jnp.int32) < length  # [bt]
        k_raw = plgpu.load(kc_ref.at[pl.ds(t0, bt), :], mask=valid[:, None], other=0).astype(jnp.int32)
        # Pointer gather from the LUT: lut[g, m, code[t, m]] summed over m -> [Gp bt]
        scores = sum(
            lut_ref[head_off + lut_sub_off[j] + part(k_raw, j)[None, :, :]].sum(axis=2) for j in range(parts)
        )
        scores = jnp.where(valid[None, :], scores, -jnp.inf)
        m_new = jnp.maximum(m_i, scores.max(axis=1))  # finite: every visited tile has a valid token
        alpha = jnp.exp(m_i - m_new)  # [Gp]
        p = jnp.exp(scores - m_new[:, None])  # [Gp bt]
        v_raw = plgpu.load(vc_ref.at[pl.ds(t0, bt), :], mask=valid[:, None], other=0).astype(jnp.int32)
        new_accs = []
        for j in range(parts):
            values = vcent_ref[cent_sub_off[j] + part(v_raw, j)[:, :, None] * sub_dim + lane].astype(
                jnp.float32
            )  # [bt Mc ds]
            new_accs.append(accs[j] * alpha[:, None, None] + (p[:, :, None, None] * values[None]).sum(axis=1))
        return m_new, l_i * alpha + p.sum(axis=1), tuple(new_accs)

    init = (
        jnp.full((group_p,), -jnp.inf, jnp.float32),
        jnp.zeros((group_p,), jnp.float32),
        tuple(jnp.zeros((group_p, columns, sub_dim), jnp.float32) for _ in range(parts)),
    )
    m_i, l_i, accs = jax.lax.fori_loop(0, num_tiles, step, init)
    seen = l_i > 0
    l_safe = jnp.where(seen, l_i, 1.0)
    for j in range(parts):
        o_ref[:, j, :, :] = accs[j] / l_safe[:, None, None]
    lse_ref[...] = jnp.where(seen, m_i + jnp.log(l_safe), -jnp.inf)


def pq_coded_partials_pallas(
    lut: jax.Array,
    k_codes: jax.Array,
    v_codes: jax.Array,
    v_cent: jax.Array,
    lengths: jax.Array,
    *,
    interpret: bool = False,
    blocks: PQBlocks | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Split-K partials of the coded tokens: (normalised out [B K S Gp M ds] fp32, lse [B K S Gp] fp32).

    Codes are one a byte `[B K T M]` or packed two a byte `[B K T M/2]` (`pallas_kernels.pq_codes`),
    which the kernel reads as they are: half the bytes per token."""
    # lut [B K Gp M C] fp32 (scale folded in); codes [B K T Mc] uint8; v_cent [Kc M C ds], Kc in {1, K}
    batch, kv_heads, group_p, subspaces, centroids = lut.shape
    capacity, columns = k_codes.shape[2:]
    parts = subspaces // columns
    if parts not in (1, 2) or parts * columns != subspaces:
        raise ValueError(f"codes of {columns} bytes a token do not hold {subspaces} subspaces")
    sub_dim = v_cent.shape[-1]
    if blocks is None:
        blocks = choose_blocks(batch, kv_heads, group_p, capacity, subspaces * sub_dim, subspaces)
    shared = v_cent.shape[0] == 1
    lut_flat = lut.reshape(batch, kv_heads, group_p * subspaces * centroids)  # [B K Gp*M*C]
    cent_flat = v_cent.reshape(v_cent.shape[0], subspaces * centroids * sub_dim)  # [Kc M*C*ds]
    splits = blocks.num_splits
    kernel = functools.partial(
        _pq_kernel,
        blocks=blocks,
        group_p=group_p,
        columns=columns,
        parts=parts,
        centroids=centroids,
        sub_dim=sub_dim,
    )
    codes_spec = pl.BlockSpec((None, None, capacity, columns), lambda b, k, s: (b, k, 0, 0))
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((batch, kv_heads, splits, group_p, parts, columns, sub_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, group_p), jnp.float32),
        ),
        grid=(batch, kv_heads, splits),
        in_specs=[
            pl.BlockSpec((batch,), lambda b, k, s: (0,)),
            pl.BlockSpec((None, None, lut_flat.shape[2]), lambda b, k, s: (b, k, 0)),
            codes_spec,
            codes_spec,
            pl.BlockSpec((None, cent_flat.shape[1]), lambda b, k, s: (0 if shared else k, 0)),
        ],
        out_specs=(
            pl.BlockSpec(
                (None, None, None, group_p, parts, columns, sub_dim), lambda b, k, s: (b, k, s, 0, 0, 0, 0)
            ),
            pl.BlockSpec((None, None, None, group_p), lambda b, k, s: (b, k, s, 0)),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=2),
        interpret=interpret,
        name="pq_decode_attention",
    )(lengths.astype(jnp.int32), lut_flat, k_codes, v_codes, cent_flat)
    # [.., parts, Mc, ds] -> [.., Mc, parts, ds] = [.., M, ds]: subspace c * parts + j
    out = jnp.swapaxes(out, -3, -2).reshape(batch, kv_heads, splits, group_p, subspaces, sub_dim)
    return out, lse


def padded_group(group: int) -> int:
    """Query heads per kv head rounded up to a power of two (Triton tensor sizes must be powers of two)."""
    return next_pow2(group)
