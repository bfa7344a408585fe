"""PQ lookup-table attention over the coded tokens on CPU: a C++ XLA FFI kernel, built on first use.

XLA's CPU gather runs at about 0.5 G lookups/s here, so a decode step that scores every coded token
through a lookup table is gather-bound far below the memory bandwidth. `pq_attention_cpu.cc` does
the same arithmetic as `pq_attention._coded_partials_xla` in one pass per (row, kv head, 4 query
heads, token split): 16-byte table loads that score 4 query heads at once, an online softmax, and a
per-centroid weight histogram instead of reconstructed values. It is compiled with the C++
compiler (`$CXX`, default `g++`) against JAX's FFI headers into a per-user cache
(`$JAXLONGCTX_KERNEL_CACHE`, default `~/.cache/jaxlongctx/kernels`), keyed by the source, the
jaxlib version and the CPU, and registered with XLA once per process. Without a compiler
`native_kernel_error()` says why and callers keep the XLA path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

SOURCE = Path(__file__).with_name("pq_attention_cpu.cc")
TARGET = "jaxlongctx_pq_coded_partials"
LANES = 4  # query heads per lookup-table entry (one 16-byte load)
_LOADED: list[ctypes.CDLL] = []  # built libraries, kept mapped for the life of the process
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-std=c++17", "-shared", "-fPIC")


def _cpu_fingerprint() -> str:
    """The machine and its instruction-set flags (the library is built with -march=native)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _cache_dir() -> Path:
    """Where built kernels are kept between processes."""
    return Path(
        os.environ.get("JAXLONGCTX_KERNEL_CACHE") or Path.home() / ".cache" / "jaxlongctx" / "kernels"
    )


def _build(compiler: str) -> Path:
    """Compile the kernel unless a build for this source, jaxlib and CPU exists; returns the library path."""
    key = hashlib.sha256(
        b"\0".join(
            [
                SOURCE.read_bytes(),
                jaxlib.__version__.encode(),
                _cpu_fingerprint().encode(),
                " ".join(_FLAGS).encode(),
            ]
        )
    ).hexdigest()[:16]
    cache = _cache_dir()
    lib = cache / f"pq_attention_cpu-{key}.so"
    if lib.is_file():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, lib)  # concurrent builders each rename a complete library into place
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def native_kernel_error() -> str | None:
    """Build and register the CPU kernel once per process; None on success, else why it is unavailable."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler {compiler!r} on PATH (set CXX)"
    try:
        lib = _build(compiler)
        handle = ctypes.CDLL(str(lib))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handle.PqCodedPartials), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as err:
        return f"building {SOURCE.name} failed: {err}"
    _LOADED.append(handle)
    return None


def native_splits(batch: int, kv_heads: int, blocks: int, length_hint: int) -> int:
    """Token splits S per (row, kv head, block): enough tasks to keep every core busy, none under 1K tokens."""
    cores = os.cpu_count() or 1
    tasks = batch * kv_heads * blocks
    wanted = -(-2 * cores // tasks)  # ceil: about two tasks per core balance uneven rows
    return max(1, min(wanted, length_hint // 1024))


def pq_coded_partials_native(
    lut: jax.Array, k_codes: jax.Array, v_codes: jax.Array, v_cent: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Coded-token partials through the CPU kernel.

    lut [B K NB M C 4] fp32 (scale folded in), codes [B K T M] uint8, v_cent [Kc M C ds] (Kc = 1 or K),
    lengths [B] -> (out [B K NB S 4 D], lse [B K NB S 4]) fp32, one normalised partial per token split.
    """
    error = native_kernel_error()
    if error is not None:
        raise RuntimeError(f"pq_decode_attention: the native CPU kernel is unavailable: {error}")
    batch, kv_heads, blocks, subspaces, _, _ = lut.shape
    head_dim = subspaces * v_cent.shape[-1]
    splits = native_splits(batch, kv_heads, blocks, k_codes.shape[2])
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
    )
