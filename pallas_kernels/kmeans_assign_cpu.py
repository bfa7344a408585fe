"""The assignment step of batched k-means on CPU: a C++ XLA FFI kernel, built on first use.

XLA's CPU loop over centroids (`jaxlongctx.kvcache.kmeans`) reaches about 2-5 G point-centroid
distances per second on 2 cores, and the cluster sums after it are scatter-adds; per-layer and
per-head calibration of a real model runs thousands of k-means problems of 16K points and 256
centroids, so those set its time. `kmeans_assign_cpu.cc` gives each problem one task on XLA's
intra-op pool: 16 points per vector, 128 points per pass over the centroids (the running minima stay
in registers), then the cluster sizes, coordinate sums and the split gains k-means needs to re-seed
an empty cluster (`jaxlongctx.kvcache.kmeans`). Built and cached like the other CPU
kernels (`pallas_kernels.native_build`); without a compiler `native_kernel_error()` says why and
k-means keeps its XLA path. PQ encoding (`jaxlongctx.kvcache.pq_codec`) uses it for its nearest-centroid
search too.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native_build

SOURCE = Path(__file__).with_name("kmeans_assign_cpu.cc")
TARGET = "jaxlongctx_kmeans_assign"


@functools.cache
def native_kernel_error() -> str | None:
    """Build and register the CPU kernel once per process; None on success, else why it is unavailable."""
    return native_build.build_and_register(SOURCE, "KmeansAssign", TARGET)


def use_native_kernel() -> bool:
    """Whether nearest-centroid searches run in this kernel: on CPU, when it builds."""
    return jax.default_backend() == "cpu" and native_kernel_error() is None


def kmeans_assign_native(
    x: jax.Array, cent: jax.Array, rms: jax.Array, split_eps: float
) -> tuple[jax.Array, ...]:
    """Nearest centroid of every point: x [P, n, ds], cent [P, k, ds], rms [P] (float32) -> assignments
    [P, n] int32, squared distances [P, n], cluster sizes [P, k], coordinate sums [P, k, ds] and split
    gains [P, k] (sum over a cluster's points of |<x - mean, delta>|, delta = split_eps * (|mean| + rms)
    with alternating signs over the coordinates), float32."""
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"kmeans_assign: the native CPU kernel is unavailable: {error}")
    p, n, ds = x.shape
    k = cent.shape[1]
    call = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct((p, n), jnp.int32),
            jax.ShapeDtypeStruct((p, n), jnp.float32),
            jax.ShapeDtypeStruct((p, k), jnp.float32),
            jax.ShapeDtypeStruct((p, k, ds), jnp.float32),
            jax.ShapeDtypeStruct((p, k), jnp.float32),
        ),
        vmap_method="sequential",
    )
    return call(
        x.astype(jnp.float32),
        cent.astype(jnp.float32),
        rms.astype(jnp.float32),
        split_eps=np.float32(split_eps),
    )
