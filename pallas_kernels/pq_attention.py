"""PQ lookup-table decode attention (MILLION): coded tokens via a per-query LUT plus an exact window."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import Backend, resolve_backend
from pallas_kernels.pq_attention_cpu import native_kernel_error, pq_decode_attention_native, reads_packed
from pallas_kernels.pq_attention_kernel import padded_group, pq_coded_partials_pallas
from pallas_kernels.pq_codes import is_packed, unpack_codes

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_HIGHEST = jax.lax.Precision.HIGHEST


def lookup_tables(
    q: jax.Array, k_cent: jax.Array, kv_heads: int, group_p: int, scale: float | jax.Array
) -> jax.Array:
    """LUT [B K Gp M C] fp32: scale * q[b, k*G+g, subspace m] . k_cent[(k,) m, c]; padded rows g >= G are zero."""
    batch, heads, _head_dim = q.shape
    subspaces, sub_dim = k_cent.shape[-3], k_cent.shape[-1]
    group = heads // kv_heads
    qg = (q.astype(jnp.float32) * scale).reshape(batch, kv_heads, group, subspaces, sub_dim)  # [B K G M ds]
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_p - group), (0, 0), (0, 0)))  # [B K Gp M ds]
    spec = "bkgmj,mcj->bkgmc" if k_cent.ndim == 3 else "bkgmj,kmcj->bkgmc"
    return jnp.einsum(spec, qg, k_cent.astype(jnp.float32), precision=_HIGHEST)


def _resolve_pq_backend(backend: str) -> str:
    """The concrete path: "auto" is the native CPU kernel on CPU when it builds, else XLA there and
    Pallas on GPU; "native" asks for the CPU kernel and fails if it cannot be built."""
    if backend == "native":
        error = native_kernel_error()
        if error is not None:
            raise ValueError(f"pq_decode_attention: backend 'native' is unavailable: {error}")
        return "native"
    resolved = resolve_backend(backend)
    if backend == "auto" and resolved == "xla" and jax.default_backend() == "cpu":
        return "native" if native_kernel_error() is None else "xla"
    return resolved


def _softmax_partial(
    scores: jax.Array, valid: jax.Array, values_fn: Callable[[jax.Array], jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Normalised partial output and log-sum-exp of masked scores [B K G S]; all-masked rows give (0, -inf)."""
    peak = jnp.max(jnp.where(valid, scores, -jnp.inf), axis=-1)  # [B K G]
    peak_safe = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.where(valid, jnp.exp(scores - peak_safe[..., None]), 0.0)  # [B K G S]
    total = weights.sum(axis=-1)
    seen = total > 0
    total_safe = jnp.where(seen, total, 1.0)
    out = values_fn(weights) / total_safe[..., None]  # [B K G D]
    return out, jnp.where(seen, peak_safe + jnp.log(total_safe), -jnp.inf)


def _window_partials(
    q: jax.Array, k_res: jax.Array, v_res: jax.Array, res_lengths: jax.Array, scale: float | jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Exact attention over the full-precision window: (out [B K G D], lse [B K G]) fp32."""
    batch, heads, head_dim = q.shape
    kv_heads, window = k_res.shape[1], k_res.shape[2]
    qg = q.astype(jnp.float32).reshape(batch, kv_heads, heads // kv_heads, head_dim)  # [B K G D]
    scores = scale * jnp.einsum("bkgd,bkrd->bkgr", qg, k_res.astype(jnp.float32), precision=_HIGHEST)
    valid = (jnp.arange(window)[None, :] < res_lengths[:, None])[:, None, None, :]  # [B 1 1 R]
    values_fn = lambda p: jnp.einsum(
        "bkgr,bkrd->bkgd",
        p,
        v_res.astype(jnp.float32),
        precision=_HIGHEST,
    )
    return _softmax_partial(scores, valid, values_fn)


def _coded_partials_xla(
    lut: jax.Array, k_codes: jax.Array, v_codes: jax.Array, v_cent: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Coded tokens without dequantizing keys: LUT gather for scores, centroid gather for values."""
    batch, kv_heads, group, subspaces, centroids = lut.shape
    capacity = k_codes.shape[2]
    sub_dim = v_cent.shape[-1]
    offsets = jnp.arange(subspaces, dtype=jnp.int32) * centroids  # [M]
    # Scores: one flat gather per (g, t, m) from the LUT rows, summed over m.
    k_idx = (k_codes.astype(jnp.int32) + offsets).reshape(batch, kv_heads, 1, capacity * subspaces)
    lut_rows = lut.reshape(batch, kv_heads, group, subspaces * centroids)  # [B K G M*C]
    picked = jnp.take_along_axis(lut_rows, k_idx, axis=3, mode="promise_in_bounds")  # [B K G T*M]
    scores = picked.reshape(batch, kv_heads, group, capacity, subspaces).sum(axis=-1)  # [B K G T]
    valid = (jnp.arange(capacity)[None, :] < lengths[:, None])[:, None, None, :]  # [B 1 1 T]
    # Values: gather centroid sub-vectors ([T M ds] = [T D]) then one matmul with the probabilities.
    cent = v_cent.astype(jnp.float32).reshape(-1, subspaces * centroids, sub_dim)[None]  # [1 Kc M*C ds]
    v_idx = (v_codes.astype(jnp.int32) + offsets).reshape(batch, kv_heads, capacity * subspaces, 1)
    cent = jnp.broadcast_to(cent, (1, kv_heads, *cent.shape[2:]))
    values = jnp.take_along_axis(cent, v_idx, axis=2, mode="promise_in_bounds")  # [B K T*M ds]
    values = values.reshape(batch, kv_heads, capacity, subspaces * sub_dim)  # [B K T D]
    values_fn = lambda p: jnp.einsum("bkgt,bktd->bkgd", p, values, precision=_HIGHEST)
    return _softmax_partial(scores, valid, values_fn)


def merge_partials(outs: jax.Array, lses: jax.Array) -> jax.Array:
    """Log-sum-exp merge of normalised partials outs [B K S G D], lses [B K S G] -> [B K G D]; all empty -> 0."""
    peak = jnp.max(lses, axis=2, keepdims=True)  # [B K 1 G]
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(lses - peak)  # exp(-inf) = 0 for empty partials
    total = weights.sum(axis=2, keepdims=True)
    weights = weights / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("bksg,bksgd->bkgd", weights, outs, precision=_HIGHEST)


def _check_inputs(
    q: jax.Array,
    k_codes: jax.Array,
    v_codes: jax.Array,
    k_cent: jax.Array,
    v_cent: jax.Array,
    lengths: jax.Array,
    k_res: jax.Array,
    v_res: jax.Array,
    res_lengths: jax.Array,
    packed: bool = False,
) -> None:
    """Raise ValueError naming the tensor for any shape or dtype that does not fit (`packed`: the codes
    are `[B, K, T, M/2]`, two 4-bit codes a byte)."""

    def fail(msg: str):
        raise ValueError(f"pq_decode_attention: {msg}")

    if q.ndim != 3:
        fail(f"q must be [B, H, D], got shape {q.shape}")
    batch, heads, head_dim = q.shape
    if k_codes.ndim != 4:
        fail(f"k_codes must be [B, K, T, M], got shape {k_codes.shape}")
    _, kv_heads, capacity, code_bytes = k_codes.shape
    subspaces = 2 * code_bytes if packed else code_bytes
    for name, arr in (("k_codes", k_codes), ("v_codes", v_codes)):
        if arr.shape != (batch, kv_heads, capacity, code_bytes):
            fail(f"{name} must be [B={batch}, K, T, M] like k_codes {k_codes.shape}, got {arr.shape}")
        if arr.dtype != jnp.uint8:
            fail(f"{name} must be uint8, got {arr.dtype}")
    if kv_heads == 0 or heads % kv_heads:
        fail(f"query heads H={heads} must be a multiple of kv heads K={kv_heads}")
    if subspaces == 0 or head_dim % subspaces:
        fail(f"head dim D={head_dim} must be a multiple of the number of subspaces M={subspaces}")
    sub_dim = head_dim // subspaces
    for name, cent in (("k_cent", k_cent), ("v_cent", v_cent)):
        ok_shape = (
            cent.ndim in (3, 4)
            and cent.shape[-3] == subspaces
            and cent.shape[-1] == sub_dim
            and (cent.ndim == 3 or cent.shape[0] == kv_heads)
            and 0 < cent.shape[-2] <= 256
        )
        if not ok_shape:
            fail(
                f"{name} must be [M={subspaces}, C<=256, ds={sub_dim}] or [K={kv_heads}, M, C, ds], got {cent.shape}"
            )
        if jnp.dtype(cent.dtype) not in _FLOAT_DTYPES:
            fail(f"{name} must be float32 or bfloat16, got {cent.dtype}")
    if k_cent.shape[-2] != v_cent.shape[-2]:
        fail(
            f"k_cent and v_cent must have the same number of centroids, got {k_cent.shape} and {v_cent.shape}"
        )
    if jnp.dtype(q.dtype) not in _FLOAT_DTYPES:
        fail(f"q must be float32 or bfloat16, got {q.dtype}")
    if k_res.ndim != 4 or k_res.shape[:2] != (batch, kv_heads) or k_res.shape[3] != head_dim:
        fail(f"k_res must be [B={batch}, K={kv_heads}, R, D={head_dim}], got {k_res.shape}")
    if v_res.shape != k_res.shape:
        fail(f"v_res must match k_res {k_res.shape}, got {v_res.shape}")
    for name, arr in (("lengths", lengths), ("res_lengths", res_lengths)):
        if arr.shape != (batch,) or not jnp.issubdtype(arr.dtype, jnp.integer):
            fail(f"{name} must be an integer vector [B={batch}], got {arr.dtype}{list(arr.shape)}")


def _check_pallas_shapes(subspaces: int, sub_dim: int) -> None:
    """The Triton lowering needs power-of-two tensor sizes for the M and ds axes."""
    for name, n in (("subspaces M", subspaces), ("subspace dim ds", sub_dim)):
        if n & (n - 1):
            raise ValueError(f"pq_decode_attention: the pallas backend needs a power-of-two {name}, got {n}")


def pq_decode_attention(
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
    *,
    backend: Backend | Literal["native"] = "auto",
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """One decode step of attention over a PQ-coded cache plus an exact window; returns [B H D] in q.dtype.

    backend: "xla" (gathers in XLA), "native" (the C++ CPU kernel, pq_attention_cpu), "pallas" (GPU),
    "interpret" (Pallas on CPU, for tests), or "auto" (native on CPU when it builds, else xla; pallas on GPU).
    With `layer`, k_codes/v_codes hold every layer's codes `[L, B, K, T, M]` and layer `layer`'s are
    attended: the native kernel reads them in place, the other backends take the layer's slice.
    Codes may be packed two a byte (`[..., M/2]`, at most 16 centroids; `pallas_kernels.pq_codes`):
    the native kernel scores them in registers and the Pallas kernel reads them as they are (half the
    bytes a token); the XLA path unpacks them first.
    """
    resolved = _resolve_pq_backend(backend)
    stacked = None
    if layer is not None:
        if k_codes.ndim != 5 or v_codes.shape != k_codes.shape:
            raise ValueError(
                f"pq_decode_attention: with a layer, codes must be [L, B, K, T, M], got {k_codes.shape}"
            )
        stacked, layer = (k_codes, v_codes), jnp.asarray(layer, jnp.int32)
        k_codes, v_codes = (jax.lax.dynamic_index_in_dim(c, layer, keepdims=False) for c in stacked)
    lengths, res_lengths = jnp.asarray(lengths), jnp.asarray(res_lengths)
    packed = is_packed(k_codes, k_cent)
    reads_as_is = resolved in ("pallas", "interpret") or (
        resolved == "native" and reads_packed(k_cent.shape[-1])
    )
    if packed and not reads_as_is:
        k_codes, v_codes = unpack_codes(k_codes), unpack_codes(v_codes)
        stacked = None if stacked is None else tuple(unpack_codes(c) for c in stacked)
        packed = False
    _check_inputs(q, k_codes, v_codes, k_cent, v_cent, lengths, k_res, v_res, res_lengths, packed)
    if resolved == "native":  # lookup tables, coded tokens, window and merge in one call
        codes = (k_codes, v_codes) if stacked is None else stacked  # in place: no slice is taken
        out = pq_decode_attention_native(
            q, *codes, k_cent, v_cent, lengths, k_res, v_res, res_lengths, scale, layer
        )
        return out.astype(q.dtype)
    batch, heads, head_dim = q.shape
    kv_heads, capacity = k_codes.shape[1:3]
    subspaces = k_cent.shape[-3]
    group = heads // kv_heads
    window_out, window_lse = _window_partials(q, k_res, v_res, res_lengths, scale)  # [B K G D], [B K G]
    outs, lses = [window_out[:, :, None]], [window_lse[:, :, None]]  # partials along a split axis S
    if capacity > 0 and resolved == "xla":
        lut = lookup_tables(q, k_cent, kv_heads, group, scale)  # [B K G M C]
        coded_out, coded_lse = _coded_partials_xla(lut, k_codes, v_codes, v_cent, lengths)
        outs.append(coded_out[:, :, None])
        lses.append(coded_lse[:, :, None])
    elif capacity > 0:
        _check_pallas_shapes(subspaces, head_dim // subspaces)
        group_p = padded_group(group)
        lut = lookup_tables(q, k_cent, kv_heads, group_p, scale)  # [B K Gp M C]
        v_cent_k = v_cent if v_cent.ndim == 4 else v_cent[None]  # [Kc M C ds]
        coded_out, coded_lse = pq_coded_partials_pallas(
            lut, k_codes, v_codes, v_cent_k, lengths, interpret=resolved == "interpret"
        )  # [B K S Gp M ds]
        splits = coded_out.shape[2]
        outs.append(coded_out[:, :, :, :group].reshape(batch, kv_heads, splits, group, head_dim))
        lses.append(coded_lse[:, :, :, :group])
    merged = merge_partials(jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2))  # [B K G D]
    return merged.reshape(batch, heads, head_dim).astype(q.dtype)
