"""Build and register the C++ XLA FFI kernels for CPU, once per source, jaxlib and machine.

A kernel's source (`pallas_kernels/*_cpu.cc`) is compiled with the C++ compiler (`$CXX`, default `g++`)
against JAX's FFI headers and the shared headers beside it (`cpu_tasks.h`) into a per-user cache
(`$JAXLONGCTX_KERNEL_CACHE`, default `~/.cache/jaxlongctx/kernels`), keyed by the source and those
headers, the jaxlib version, the CPU's instruction-set flags and the compiler flags, and its handler is registered with XLA once per process.
`build_and_register(source, symbol, target)` returns None when the kernel is ready, else why it is
not (no compiler, a failed build): callers then keep their XLA path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-std=c++17", "-shared", "-fPIC")
_LOADED: list[ctypes.CDLL] = []  # built libraries, kept mapped for the life of the process


def cpuinfo(*keys: str) -> str:
    """The value of the first `/proc/cpuinfo` line named by one of `keys` ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in keys:
                return value.strip()
    except OSError:
        pass
    return ""


def _cpu_fingerprint() -> str:
    """The machine and its instruction-set flags (libraries are built with -march=native)."""
    return f"{platform.machine()} {cpuinfo('flags', 'Features')}"


def cache_dir() -> Path:
    """Where built kernels are kept between processes."""
    return Path(
        os.environ.get("JAXLONGCTX_KERNEL_CACHE") or Path.home() / ".cache" / "jaxlongctx" / "kernels"
    )


def build(source: Path, compiler: str) -> Path:
    """Compile `source` unless a build for it, this jaxlib and this CPU exists; the library's path."""
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                *(header.read_bytes() for header in sorted(source.parent.glob("*.h"))),
                jaxlib.__version__.encode(),
                _cpu_fingerprint().encode(),
                " ".join(FLAGS).encode(),
            ]
        )
    ).hexdigest()[:16]
    cache = cache_dir()
    lib = cache / f"{source.stem}-{key}.so"
    if lib.is_file():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{source.parent}", str(source), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, lib)  # concurrent builders each rename a complete library into place
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def build_and_register(source: Path, symbol: str, target: str) -> str | None:
    """Build `source` and register its handler `symbol` as the CPU FFI target `target` (call it once per
    process: each kernel module caches it); None on success, else why the kernel is unavailable."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler {compiler!r} on PATH (set CXX)"
    try:
        handle = ctypes.CDLL(str(build(source, compiler)))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as err:
        return f"building {source.name} failed: {err}"
    _LOADED.append(handle)
    return None
