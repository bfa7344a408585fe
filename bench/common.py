"""Shared benchmark helpers: side-by-side timing, environment capture, JSON + PNG output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from pallas_kernels import native_build
from pallas_kernels.native_build import cpuinfo

REPO_ROOT = Path(__file__).resolve().parent.parent
# JAXLONGCTX_BENCH_RESULTS redirects every result elsewhere (bench/device_run.py gives each step its own folder).
RESULTS_DIR = Path(os.environ.get("JAXLONGCTX_BENCH_RESULTS") or REPO_ROOT / "bench" / "results")
# Set by `use_quick_results`: a `--quick` run writes `<name>_quick.json/png` (not committed), so that it
# never overwrites the full results the README quotes.
_QUICK = False


def use_quick_results(quick: bool) -> bool:
    """Call once after parsing a bench's arguments: with `quick`, results go to `<name>_quick.*`."""
    global _QUICK
    _QUICK = bool(quick)
    return _QUICK


def result_name(name: str) -> str:
    """The file stem results of `name` are written under in this run."""
    return f"{name}_quick" if _QUICK and not name.endswith("_quick") else name


# instruction-set extensions that change which CPU kernels are fast (bf16 dot products, matrix tiles)
CPU_FEATURES = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512vbmi",
    "avx512_bf16",
    "amx_bf16",
    "amx_tile",
)


def cpu_model() -> dict[str, Any]:
    """The CPU's model name and which of CPU_FEATURES it has (from /proc/cpuinfo; empty elsewhere)."""
    flags = set(cpuinfo("flags").split())
    return {
        "cpu": cpuinfo("model name") or platform.processor(),
        "cpu_features": [f for f in CPU_FEATURES if f in flags],
        "kernel_build": {"march": native_build.march(), "vector_tier": native_build.vector_tier()},
    }


def environment() -> dict[str, Any]:
    """Describe the machine and library versions a result was measured on."""
    import flax
    import numpy as np

    devices = jax.devices()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        **cpu_model(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "numpy": np.__version__,
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in devices],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def block(x: Any) -> Any:
    """Wait for every array in a pytree (so timings include the device work)."""
    return jax.block_until_ready(x)


def interleaved_times(fns: dict[str, Callable[[], Any]], *, repeats: int = 5) -> dict[str, dict[str, float]]:
    """Time several functions side by side, alternating calls so machine noise hits all alike."""
    out: dict[str, dict[str, float]] = {}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for name, fn in fns.items():  # warm-up / compile
        t0 = time.perf_counter()
        block(fn())
        out[name] = {"first_call_s": time.perf_counter() - t0}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            block(fn())
            samples[name].append(time.perf_counter() - t0)
    for name, ts in samples.items():
        out[name].update({"median_s": statistics.median(ts), "min_s": min(ts), "repeats": repeats})
    return out


def repo_path(path: str | Path) -> str:
    """`path` relative to the repository when it lies inside it (results stay machine-independent)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else str(path)


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write `bench/results/<name>.json` (`<name>_quick.json` in a quick run) atomically, with the
    environment added; returns the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{result_name(name)}.json"
    payload = {"name": name, "environment": environment(), **payload}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    os.replace(tmp, path)  # a killed run leaves the previous result whole
    print(f"wrote {path}")
    return path


def plot_path(name: str) -> Path:
    """Where the PNG plot of benchmark `name` goes."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / f"{result_name(name)}.png"


def subplots(*args: Any, **kwargs: Any) -> Any:
    """`matplotlib.pyplot.subplots` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_plot(fig: Any, path: Path, *, dpi: int = 120, **layout: Any) -> Path:
    """Lay out, write and close a figure; `layout` goes to `tight_layout`."""
    import matplotlib.pyplot as plt

    fig.tight_layout(**layout)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"wrote {path}")
    return path
