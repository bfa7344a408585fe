"""Build and register the C++ XLA FFI kernels for CPU, once per source, jaxlib and machine.

A kernel's source (`pallas_kernels/*_cpu.cc`) is compiled with the C++ compiler (`$CXX`, default `g++`)
against JAX's FFI headers and the shared headers beside it (`cpu_tasks.h`) into a per-user cache
(`$JAXLONGCTX_KERNEL_CACHE`, default `~/.cache/jaxlongctx/kernels`), keyed by the source and those
headers, the jaxlib version, the CPU's instruction-set flags and the compiler flags, and its handler is registered with XLA once per process.

Kernels are built for this CPU (`-march=native`): the instruction-set tier (AVX-512, AVX/AVX2, or the
128-bit base tier) is chosen at compile time in `cpu_vector_math.h`. `$JAXLONGCTX_KERNEL_MARCH` builds
for another `-march` instead (e.g. `x86-64`, the base tier, or `x86-64-v3`, AVX2): the tests run every
tier this CPU can execute that way, and `compile_check` compiles a tier it cannot (AVX-512 anywhere).
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

COMMON_FLAGS = ("-O3", "-ffast-math", "-fno-finite-math-only", "-std=c++17", "-fPIC")
MARCH_ENV = "JAXLONGCTX_KERNEL_MARCH"
# The -march of the AVX-512 tier with the extensions the PQ kernel uses (a compile check where it cannot run).
AVX512_MARCH = ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vbmi")
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


def march() -> str:
    """The -march the kernels are built for: `$JAXLONGCTX_KERNEL_MARCH`, default `native` (this CPU)."""
    return os.environ.get(MARCH_ENV) or "native"


def flags() -> tuple[str, ...]:
    """The compiler flags of a kernel library for `march()`."""
    return (*COMMON_FLAGS, f"-march={march()}", "-shared")


def vector_tier() -> str:
    """The instruction-set tier the kernels are built for (`cpu_vector_math.h`): "AVX-512", "AVX2" (AVX/AVX2)
    or "base" (128-bit); for `march()` native, this CPU's."""
    level = {"x86-64": "base", "x86-64-v2": "base", "x86-64-v3": "AVX2", "x86-64-v4": "AVX-512"}.get(march())
    if level:
        return level
    flags = cpuinfo("flags", "Features").split()
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx" in flags else "base"


def compiler() -> str:
    """The C++ compiler: `$CXX`, default `g++`."""
    return os.environ.get("CXX", "g++")


def compile_check(source: Path, march_flags: tuple[str, ...] = AVX512_MARCH) -> str | None:
    """Compile `source` to an object file for another instruction-set tier (not linked, not loaded: the
    CPU need not run it); None on success, else the compiler's errors."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [compiler(), *COMMON_FLAGS, *march_flags, f"-I{jax.ffi.include_dir()}", f"-I{source.parent}"]
        done = subprocess.run([*cmd, "-c", str(source), "-o", f"{tmp}/out.o"], capture_output=True, text=True)
    return done.stderr.strip() if done.returncode else None


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
                " ".join(flags()).encode(),
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
        cmd = [compiler, *flags(), f"-I{jax.ffi.include_dir()}", f"-I{source.parent}", str(source), "-o", tmp]
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
    cxx = compiler()
    if shutil.which(cxx) is None:
        return f"no C++ compiler {cxx!r} on PATH (set CXX)"
    try:
        handle = ctypes.CDLL(str(build(source, cxx)))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as err:
        return f"building {source.name} failed: {err}"
    _LOADED.append(handle)
    return None
