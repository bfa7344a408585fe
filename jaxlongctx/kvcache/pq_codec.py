"""Product-quantization codec: nearest-centroid encode / gather decode per subspace.

Centroid layouts (one function handles both, chosen by centroids.ndim):
  shared   centroids [M, C, ds]     applied to x[..., D]; codes[..., M]
  per head centroids [K, M, C, ds]  applied to x[..., K, T, D] (kv-head axis is x's axis -3,
                                    sized K); codes[..., K, T, M]
with D = M * ds and C <= 4096: codes are uint8 up to 256 centroids (8-bit codes), uint16 above
(10- to 12-bit codes). Distances are squared L2 in float32. On CPU the nearest-centroid search runs in
the C++ k-means assignment kernel (`pallas_kernels.kmeans_assign_cpu`, one task per subspace; about
100x XLA's small batched matmuls for ds 2), elsewhere in XLA.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from pallas_kernels import kmeans_assign_cpu

# Elements of one [rows, M, C] distance block while encoding; 2**24 float32 = 64 MB.
DEFAULT_CHUNK_ELEMS = 1 << 24
MAX_CENTROIDS = 4096  # 12-bit codes


def code_dtype(num_centroids: int) -> jnp.dtype:
    """The narrowest unsigned integer that holds a code of `num_centroids` centroids (uint8 or uint16)."""
    return jnp.dtype(jnp.uint8) if num_centroids <= 256 else jnp.dtype(jnp.uint16)


def _check(x_shape: tuple[int, ...], centroids: jax.Array, what: str) -> tuple[int, int, int]:
    """Validate a (x, centroids) pair; returns (M, C, ds)."""
    if centroids.ndim not in (3, 4):
        raise ValueError(f"centroids must be [M, C, ds] or [K, M, C, ds], got shape {centroids.shape}")
    m, c, ds = centroids.shape[-3:]
    if c > MAX_CENTROIDS:
        raise ValueError(f"centroids has C={c} > {MAX_CENTROIDS} per subspace (codes of at most 12 bits)")
    if centroids.ndim == 4:
        kv = centroids.shape[0]
        if len(x_shape) < 3 or x_shape[-3] != kv:
            raise ValueError(
                f"per-kv-head centroids {centroids.shape} need {what} shaped [..., K={kv}, T, ...], got {x_shape}"
            )
    return m, c, ds


def _encode_rows(x: jax.Array, centroids: jax.Array, rows: int, native: bool) -> jax.Array:
    """x[N, D] with centroids[M, C, ds] -> codes[N, M] (`code_dtype(C)`): through the C++ kernel with
    `native` (each subspace one problem), else in blocks of `rows` rows."""
    n, _d = x.shape
    m, _c, ds = centroids.shape
    if native:
        return _nearest_in_kernel(x.reshape(n, m, ds).transpose(1, 0, 2), centroids).T  # [M, N] -> [N, M]
    rows = max(1, min(rows, n))  # a short input is not padded up to a whole block
    steps = -(-n // rows)
    xs = jnp.pad(x, ((0, steps * rows - n), (0, 0))).reshape(steps, rows, m, ds)
    c_sq = jnp.sum(jnp.square(centroids), axis=-1)  # [M, C]

    def block(xb):  # [rows, M, ds] -> [rows, M]
        # |x - c|^2 = |x|^2 - 2 x.c + |c|^2; |x|^2 is the same for every c of a subspace.
        dots = jnp.einsum("rmd,mcd->rmc", xb, centroids, precision=jax.lax.Precision.HIGHEST)
        return jnp.argmin(c_sq - 2.0 * dots, axis=-1).astype(code_dtype(_c))

    return jax.lax.map(block, xs).reshape(steps * rows, m)[:n]


def encode(
    x: jax.Array,
    centroids: jax.Array,
    weights: jax.Array | None = None,
    *,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> jax.Array:
    """Nearest centroid per subspace: x[..., D] -> codes[..., M], uint8 or uint16 (`code_dtype`; layouts:
    module docstring).

    `weights` (positive, per channel: [D] with shared centroids, [K, D] with per-head ones) make the
    distance sum_j w_j (x_j - c_j)^2: nearest in the space scaled by sqrt(w), where weighted k-means
    trained the centroids.
    """
    x = jnp.asarray(x)
    centroids = jnp.asarray(centroids, jnp.float32)
    m, _c, ds = _check(x.shape, centroids, "x")
    if x.shape[-1] != m * ds:
        raise ValueError(
            f"x has last dim {x.shape[-1]}, centroids {centroids.shape} need D = M*ds = {m * ds}"
        )
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
    x = x.astype(jnp.float32)
    if weights is not None:
        x, centroids = _scale_by_weights(x, centroids, jnp.asarray(weights, jnp.float32))
    return _encode_jit(x, centroids, chunk_elems, kmeans_assign_cpu.use_native_kernel())


def _scale_by_weights(x: jax.Array, centroids: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x and centroids scaled per channel by sqrt(weights) ([D] or [K, D], matching the centroids)."""
    want = centroids.shape[:-3] + (x.shape[-1],)
    if weights.shape != want:
        raise ValueError(
            f"weights must have shape {want} for centroids {centroids.shape}, got {weights.shape}"
        )
    scale = jnp.sqrt(weights)
    m, _, ds = centroids.shape[-3:]
    scaled_centroids = centroids * scale.reshape(*scale.shape[:-1], m, 1, ds)
    return x * (scale if scale.ndim == 1 else scale[:, None, :]), scaled_centroids


def _nearest_in_kernel(points: jax.Array, centroids: jax.Array) -> jax.Array:
    """Nearest centroid index (`code_dtype`) of points [P, N, ds] among centroids [P, C, ds] -> [P, N],
    by the C++ kernel."""
    p, c = centroids.shape[:2]
    assign = kmeans_assign_cpu.kmeans_assign_native(points, centroids, jnp.zeros((p,), jnp.float32), 0.0)[0]
    return assign.astype(code_dtype(c))


@partial(jax.jit, static_argnames=("chunk_elems", "native"))
def _encode_jit(x: jax.Array, centroids: jax.Array, chunk_elems: int, native: bool) -> jax.Array:
    """Jitted body of `encode` (inputs already validated, float32)."""
    m, c, _ = centroids.shape[-3:]
    if centroids.ndim == 3:
        rows = max(1, chunk_elems // (m * c))
        flat = x.reshape(-1, x.shape[-1])
        return _encode_rows(flat, centroids, rows, native).reshape(*x.shape[:-1], m)
    kv = centroids.shape[0]
    rows = max(1, chunk_elems // (kv * m * c))
    heads_first = jnp.moveaxis(x, -3, 0)  # [K, ..., T, D]
    flat = heads_first.reshape(kv, -1, x.shape[-1])  # [K, N, D]
    if native:  # every (head, subspace) one problem of the kernel
        n, ds = flat.shape[1], centroids.shape[-1]
        problems = flat.reshape(kv, n, m, ds).transpose(0, 2, 1, 3).reshape(kv * m, n, ds)
        codes = _nearest_in_kernel(problems, centroids.reshape(kv * m, c, ds))
        codes = codes.reshape(kv, m, n).transpose(0, 2, 1)  # [K, N, M]
    else:
        codes = jax.vmap(lambda xk, ck: _encode_rows(xk, ck, rows, False))(flat, centroids)  # [K, N, M]
    return jnp.moveaxis(codes.reshape(*heads_first.shape[:-1], m), 0, -3)


def decode(codes: jax.Array, centroids: jax.Array) -> jax.Array:
    """Gather and concatenate centroids: codes[..., M] -> x_hat[..., D] float32 (layouts: module docstring)."""
    codes = jnp.asarray(codes)
    centroids = jnp.asarray(centroids, jnp.float32)
    m, _, _ = _check(codes.shape, centroids, "codes")
    if codes.shape[-1] != m:
        raise ValueError(f"codes has last dim {codes.shape[-1]}, centroids {centroids.shape} have M = {m}")
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise ValueError(f"codes must be integers, got {codes.dtype}")
    return _decode_jit(codes, centroids)


def _decode_rows(codes: jax.Array, centroids: jax.Array) -> jax.Array:
    """codes[N, M] with centroids[M, C, ds] -> [N, M * ds]."""
    m, _, ds = centroids.shape
    picked = centroids[jnp.arange(m), codes.astype(jnp.int32)]  # [N, M, ds]
    return picked.reshape(codes.shape[0], m * ds)


@jax.jit
def _decode_jit(codes: jax.Array, centroids: jax.Array) -> jax.Array:
    """Jitted body of `decode` (inputs already validated)."""
    m, _, ds = centroids.shape[-3:]
    if centroids.ndim == 3:
        return _decode_rows(codes.reshape(-1, m), centroids).reshape(*codes.shape[:-1], m * ds)
    kv = centroids.shape[0]
    heads_first = jnp.moveaxis(codes, -3, 0)  # [K, ..., T, M]
    out = jax.vmap(_decode_rows)(heads_first.reshape(kv, -1, m), centroids)  # [K, N, D]
    return jnp.moveaxis(out.reshape(*heads_first.shape[:-1], m * ds), 0, -3)


def fake_quantize(x: jax.Array, centroids: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """decode(encode(x)) in x's dtype: what attention sees from a PQ cache."""
    x = jnp.asarray(x)
    return decode(encode(x, centroids, weights), centroids).astype(x.dtype)
