"""The byte layout of PQ codes that the decode-attention paths read: one code a byte, or two packed.

Codes of at most 16 centroids (4-bit codes) over an even number of subspaces M are stored two a byte,
`[..., M/2]` uint8: subspace 2p in the low nibble of byte p, subspace 2p + 1 in the high one. That
halves the cache; the CPU kernel's register path and the Pallas GPU kernel read it as it is, the
XLA path unpacks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_PACKED_CENTROIDS = 16  # a code in 4 bits


def packs(num_centroids: int, subspaces: int) -> bool:
    """Whether codes of `num_centroids` centroids over `subspaces` subspaces are stored two a byte."""
    return num_centroids <= MAX_PACKED_CENTROIDS and subspaces % 2 == 0


def code_bytes(num_centroids: int, subspaces: int) -> int:
    """Bytes of one token's codes (per kv head): M, or M/2 packed."""
    return subspaces // 2 if packs(num_centroids, subspaces) else subspaces


def pack_codes(codes: jax.Array) -> jax.Array:
    """codes `[..., M]` (values < 16, M even) -> `[..., M/2]` uint8, two a byte."""
    codes = codes.astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """`[..., M/2]` packed codes -> `[..., M]` uint8, one a byte."""
    return jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def is_packed(codes: jax.Array, centroids: jax.Array) -> bool:
    """Whether `codes [..., N]` are the packed form for `centroids [(K,) M, C, ds]` (N = M/2)."""
    subspaces, num_centroids = centroids.shape[-3], centroids.shape[-2]
    return codes.shape[-1] * 2 == subspaces and packs(num_centroids, subspaces)
