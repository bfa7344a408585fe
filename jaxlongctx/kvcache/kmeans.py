"""Batched Lloyd k-means (faiss style) over many independent problems at once, in JAX (the assignment
step in a C++ kernel on CPU)."""

from __future__ import annotations

from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from pallas_kernels import kmeans_assign_cpu
from pallas_kernels.kmeans_assign_cpu import kmeans_assign_native

# Relative size of the perturbation used when a large cluster is split to fill an empty one.
SPLIT_EPS = 1.0 / 1024

Init = Literal["random", "kmeans++"]


def _segment_sum(vals: jax.Array, ids: jax.Array, k: int) -> jax.Array:
    """Per-problem segment sum: vals[P, n, ...] grouped by ids[P, n] into [P, k, ...]."""
    return jax.vmap(lambda v, i: jax.ops.segment_sum(v, i, num_segments=k))(vals, ids)


# Points per tile of the XLA assignment step: a tile of up to 64 problems and _TILE_ELEMENTS points in
# all keeps its running minimum in cache while every centroid passes over it (4x faster on CPU than
# sweeping all points per centroid, 2.5x faster than tiles of every problem at once when P is large).
_TILE_ELEMENTS = 1 << 15
_TILE_PROBLEMS = 64


def _nearest(coords: list[jax.Array], cent: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Squared distance to, and index of, the nearest centroid for points given as ds coordinate
    arrays [P, b]: one centroid at a time with a running minimum; ties go to the lowest index."""
    _p, k, ds = cent.shape

    def body(i, best):
        best_d, best_i = best
        ci = jax.lax.dynamic_index_in_dim(cent, i, axis=1, keepdims=False)  # [P, ds]
        d = sum(jnp.square(coords[j] - ci[:, j, None]) for j in range(ds))  # [P, b]
        closer = d < best_d
        return jnp.where(closer, d, best_d), jnp.where(closer, i, best_i)

    init = (jnp.full(coords[0].shape, jnp.inf, jnp.float32), jnp.zeros(coords[0].shape, jnp.int32))
    return jax.lax.fori_loop(0, k, body, init)


def _assign(
    x: jax.Array, cent: jax.Array, rms: jax.Array, native: bool
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Nearest centroid of every point x[P, n, ds]: assignments [P, n], counts [P, k], sums [P, k, ds],
    SSE [P] and, from the C++ kernel only, the split gains [P, k] (`_split_gain`; else None).

    With `native` the C++ CPU kernel (`pallas_kernels.kmeans_assign_cpu`) does it; else XLA cuts the points
    into tiles of pc problems and b points, and each tile meets every centroid in turn, so memory
    stays O(P * n) whatever k is.
    """
    if native:
        assign, dist, counts, sums, gain = kmeans_assign_native(x, cent, rms, SPLIT_EPS)
        return assign, counts, sums, jnp.sum(dist, axis=-1), gain
    p, n, ds = x.shape
    k = cent.shape[1]
    pc = min(p, _TILE_PROBLEMS)
    b = min(n, _TILE_ELEMENTS // pc)
    xp = jnp.pad(x, ((0, -p % pc), (0, -n % b), (0, 0)))
    tiles = xp.reshape(xp.shape[0] // pc, pc, -1, b, ds).transpose(0, 2, 4, 1, 3)  # [P/pc, n/b, ds, pc, b]
    cent_chunks = jnp.pad(cent, ((0, -p % pc), (0, 0), (0, 0))).reshape(-1, pc, k, ds)

    def problem_chunk(args):  # one chunk's tiles [n/b, ds, pc, b] and centroids [pc, k, ds]
        chunk_tiles, chunk_cent = args
        return jax.lax.map(lambda tile: _nearest(list(tile), chunk_cent), chunk_tiles)  # 2x [n/b, pc, b]

    best_d, assign = (
        a.transpose(0, 2, 1, 3).reshape(xp.shape[:2])[:p, :n]
        for a in jax.lax.map(problem_chunk, (tiles, cent_chunks))
    )
    counts = _segment_sum(jnp.ones(assign.shape, jnp.float32), assign, k)
    sums = _segment_sum(x, assign, k)
    return assign, counts, sums, jnp.sum(best_d, axis=-1), None


@partial(jax.jit, static_argnames="native")
def _objective(x: jax.Array, cent: jax.Array, native: bool) -> jax.Array:
    """Mean squared distance of each problem's points x[P, n, ds] to their nearest centroid: [P]."""
    return _assign(x, cent, jnp.zeros(x.shape[0], jnp.float32), native)[3] / x.shape[1]


@partial(jax.jit, static_argnames="native")
def _lloyd_step(x: jax.Array, cent: jax.Array, rms: jax.Array, native: bool) -> tuple[jax.Array, jax.Array]:
    """Assign, move centroids to their means, re-seed empty clusters by splitting large ones.

    Returns (new centroids [P, k, ds], objective of the INPUT centroids [P]). The objective of
    the new centroids is never larger (up to float rounding): nonempty clusters move to their
    means; an empty cluster e takes a copy of a donor mean mu_d (donors: largest clusters
    first) at mu_d + delta. The donor moves to mu_d - delta (faiss's symmetric split) only
    when that provably lowers its cost, i.e. when n_d |delta|^2 < 2 sum_i |<x_i - mu_d, delta>|
    over its points (and no donor serves two empty clusters); otherwise it stays at mu_d, so
    the copy only adds an option.
    """
    assign, counts, sums, sse, gain = _assign(x, cent, rms, native)
    nonempty = counts > 0
    means = jnp.where(nonempty[..., None], sums / jnp.maximum(counts, 1.0)[..., None], cent)
    alternating = jnp.where(jnp.arange(cent.shape[2]) % 2 == 0, 1.0, -1.0)
    delta = SPLIT_EPS * (jnp.abs(means) + rms[:, None, None]) * alternating  # [P, k, ds]
    if gain is None:  # XLA reads every point again for the gains: only when a cluster is empty
        new = jax.lax.cond(
            jnp.any(~nonempty),
            lambda: _reseed_empty(counts, means, delta, _split_gain(x, assign, means, delta)),
            lambda: means,
        )
    else:
        new = _reseed_empty(counts, means, delta, gain)
    return new, sse / x.shape[1]


def _split_gain(x: jax.Array, assign: jax.Array, means: jax.Array, delta: jax.Array) -> jax.Array:
    """sum over each cluster's points of |<x - mean, delta>|: x [P, n, ds], assign [P, n] -> [P, k]."""
    mu = jnp.take_along_axis(means, assign[..., None], axis=1)  # [P, n, ds]
    dl = jnp.take_along_axis(delta, assign[..., None], axis=1)
    return _segment_sum(jnp.abs(jnp.sum((x - mu) * dl, axis=-1)), assign, means.shape[1])


def _reseed_empty(counts: jax.Array, means: jax.Array, delta: jax.Array, gain: jax.Array) -> jax.Array:
    """Means [P, k, ds] with each empty cluster (counts 0) re-seeded by splitting a large one
    (`_lloyd_step` gives the rule; delta [P, k, ds] the split, gain [P, k] `_split_gain`)."""
    k = means.shape[1]
    split_lowers_cost = counts * jnp.sum(jnp.square(delta), axis=-1) < 2.0 * gain  # [P, k]
    empty = counts == 0
    n_empty = jnp.sum(empty, axis=-1, keepdims=True)
    n_nonempty = k - n_empty
    by_size = jnp.argsort(-counts, axis=-1, stable=True)  # donors, largest first
    empty_rank = jnp.cumsum(empty, axis=-1) - 1
    donor = jnp.take_along_axis(by_size, empty_rank % jnp.maximum(n_nonempty, 1), axis=-1)  # [P, k]
    copy = jnp.take_along_axis(means, donor[..., None], axis=1) + jnp.take_along_axis(
        delta, donor[..., None], axis=1
    )
    new = jnp.where(empty[..., None], copy, means)
    symmetric = empty & (n_empty <= n_nonempty) & jnp.take_along_axis(split_lowers_cost, donor, axis=-1)
    donor_moves = _segment_sum(symmetric.astype(jnp.float32), jnp.where(symmetric, donor, 0), k) > 0
    return jnp.where(donor_moves[..., None], new - delta, new)


def _init_random(x: jax.Array, k: int, key: jax.Array) -> jax.Array:
    """The points at k distinct random indices, the same indices in every problem (one draw of k, not
    P permutations of n: the problems hold independent data): x[P, n, ds] -> [P, k, ds]."""
    return x[:, jax.random.choice(key, x.shape[1], (k,), replace=False)]


@partial(jax.jit, static_argnums=1)
def _init_kmeanspp(x: jax.Array, k: int, key: jax.Array) -> jax.Array:
    """k-means++ seeding per problem (D^2 sampling): x[P, n, ds] -> [P, k, ds]."""
    p, n, ds = x.shape
    rows = jnp.arange(p)
    key, sub = jax.random.split(key)
    c0 = x[rows, jax.random.randint(sub, (p,), 0, n)]
    d2 = jnp.sum(jnp.square(x - c0[:, None]), axis=-1)  # [P, n]
    cent = jnp.zeros((p, k, ds), jnp.float32).at[:, 0].set(c0)

    def body(i, carry):
        cent, d2, key = carry
        key, sub = jax.random.split(key)
        logits = jnp.where(d2 > 0, jnp.log(jnp.where(d2 > 0, d2, 1.0)), -jnp.inf)
        logits = jnp.where(jnp.any(d2 > 0, axis=-1, keepdims=True), logits, 0.0)  # all covered: uniform
        c = x[rows, jax.random.categorical(sub, logits, axis=-1)]
        d2 = jnp.minimum(d2, jnp.sum(jnp.square(x - c[:, None]), axis=-1))
        return cent.at[:, i].set(c), d2, key

    cent, _, _ = jax.lax.fori_loop(1, k, body, (cent, d2, key))
    return cent


def kmeans(
    x: jax.Array,
    k: int,
    iters: int = 25,
    *,
    key: jax.Array,
    init: Init = "random",
    max_points_per_centroid: int = 256,
    tol: float = 0.0,
    progress: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Lloyd k-means on P independent problems x[P, N, ds] -> (centroids [P, k, ds], objective [P, T+1]).

    objective[:, 0] is the mean squared distance to the initial centroids, objective[:, i]
    after i updates; it never increases (up to float32 rounding). T = iters, or fewer when `tol` > 0:
    the loop stops once the objective summed over the problems fell by at most the fraction `tol` in
    one update.
    Each problem is subsampled (same random points for all problems, deterministic given `key`) to at
    most max_points_per_centroid * k points. Memory is O(P * N * ds). The assignment step runs in
    the C++ CPU kernel on CPU when it builds (`kmeans_assign_cpu.use_native_kernel`), else in XLA.
    """
    x = jnp.asarray(x)
    if x.ndim != 3:
        raise ValueError(f"x must have shape [P, N, ds], got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be floating point, got {x.dtype}")
    p, n, _ = x.shape
    if k < 1 or k > n:
        raise ValueError(f"k must be in [1, N={n}], got {k}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    if init not in ("random", "kmeans++"):
        raise ValueError(f"init must be 'random' or 'kmeans++', got {init!r}")
    if max_points_per_centroid < 1:
        raise ValueError(f"max_points_per_centroid must be >= 1, got {max_points_per_centroid}")
    x = x.astype(jnp.float32)
    key_sub, key_init = jax.random.split(key)
    n_max = max_points_per_centroid * k
    if n > n_max:
        x = x[:, jax.random.choice(key_sub, n, (n_max,), replace=False)]

    cent = _init_random(x, k, key_init) if init == "random" else _init_kmeanspp(x, k, key_init)
    rms = jnp.sqrt(jnp.mean(jnp.square(x), axis=(1, 2)))  # [P] scale for the split perturbation

    if not tol >= 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    native = kmeans_assign_cpu.use_native_kernel()
    history = []
    bar = tqdm(range(iters), desc=f"k-means (P={p}, k={k})", disable=not progress)
    for _ in bar:
        cent, obj = _lloyd_step(x, cent, rms, native)
        history.append(jax.block_until_ready(obj))
        if (
            tol
            and len(history) > 1
            and float(jnp.sum(history[-2] - history[-1])) <= tol * float(jnp.sum(history[-2]))
        ):
            bar.close()  # converged: the objective below is that of the centroids just computed
            break
    history.append(_objective(x, cent, native))
    return cent, jnp.stack(history, axis=1)
