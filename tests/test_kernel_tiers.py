"""Every instruction-set tier of the C++ CPU kernels against its reference, whatever this host's tier.

The kernels choose their vector width at compile time (`pallas_kernels/cpu_vector_math.h`: AVX-512,
AVX/AVX2, or the 128-bit base tier). The default run tests the host's own build (`-march=native`); here
the kernels' reference tests run again in a subprocess built for each lower tier this CPU can execute
(`$JAXLONGCTX_KERNEL_MARCH`), and the AVX-512 tier, which this CPU may not run, must at least compile.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pallas_kernels import native_build

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the tiers below are x86-64 -march levels"
)
SOURCES = sorted(Path(native_build.__file__).parent.glob("*_cpu.cc"))
# The reference tests of every CPU kernel (dense products and their GEMM path, decode attention, k-means,
# PQ attention, prefill attention).
REFERENCE_TESTS = (
    "tests/test_layer_matvec.py::test_matches_a_float64_reference",
    "tests/test_layer_matvec.py::test_normalised_input_equals_the_norm_then_the_product",
    "tests/test_decode_attention_cpu.py::test_equals_the_xla_path_on_the_layer_slice",
    "tests/test_pq_codec.py::test_tiled_assignment_equals_brute_force[native-2]",
    "tests/test_pq_attention_kernel.py::test_native_path_matches_oracle",
    "tests/test_pq_attention_kernel.py::test_native_register_path_matches_oracle",
    "tests/test_prefill_attention_cpu.py::test_equals_the_xla_path",
)
# -march level -> the /proc/cpuinfo flags a CPU needs to run it, and the tier it builds
LOWER_TIERS = {"x86-64": ((), "base"), "x86-64-v3": (("avx2", "fma", "bmi2"), "AVX2")}


def _compiler_or_skip() -> None:
    import shutil

    if shutil.which(native_build.compiler()) is None:
        pytest.skip(f"no C++ compiler {native_build.compiler()!r}")


def test_the_avx512_tier_compiles():
    """Every kernel source compiles with AVX-512 (and the BF16 / VBMI extensions the PQ kernel uses)."""
    _compiler_or_skip()
    with ThreadPoolExecutor(2) as pool:
        errors = dict(zip(SOURCES, pool.map(native_build.compile_check, SOURCES)))
    assert len(SOURCES) == 5
    assert all(e is None for e in errors.values()), {s.name: e for s, e in errors.items() if e}


@pytest.mark.parametrize("march", sorted(LOWER_TIERS))
def test_a_lower_tier_matches_the_references(march):
    """The kernels built for a lower -march than this CPU's pass the reference tests; a tier that is the
    host's own (tested by the default run) or one the CPU cannot execute is not repeated here."""
    _compiler_or_skip()
    needs, tier = LOWER_TIERS[march]
    cpu = native_build.cpuinfo("flags").split()
    if not all(flag in cpu for flag in needs):
        pytest.skip(f"this CPU cannot run the {tier} tier")
    if tier == native_build.vector_tier():
        pytest.skip(f"the {tier} tier is this host's own build, tested by the default run")
    env = {**os.environ, native_build.MARCH_ENV: march, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *REFERENCE_TESTS],
        cwd=Path(__file__).parents[1],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-1000:]
