"""The device's physical ceilings, measured: memory read bandwidth and bf16 matmul FLOP/s.

Benchmarks put their ratios beside these (decode reads memory, prefill multiplies), so that a
speed-up reads as a fraction of what the hardware allows. Read bandwidth: a float32-accumulated
sum over a bf16 array far larger than any cache (every byte read once, nothing written). Matmul:
square bf16 products with float32 accumulation, 2 N^3 FLOPs each.

    python -m bench.device_limits [--cpu-dry-run]

On a GPU: 4 GiB read, N = 8192 and 16384. `--cpu-dry-run`: 64 MiB and
N = 512 on CPU (checks the script; CPU numbers are context only). Writes `device_limits.json`.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp

from bench.common import interleaved_times, write_result

GIB = 2**30


def read_bandwidth(num_bytes: int, repeats: int) -> dict[str, Any]:
    """Bytes per second of one full read of a bf16 array of `num_bytes`."""
    x = jnp.ones((num_bytes // 2 // 4096, 4096), jnp.bfloat16)  # 2-D: element counts past 2^31 stay indexable
    read = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    t = interleaved_times({"read": lambda: read(x)}, repeats=repeats)["read"]
    return {
        "bytes": num_bytes,
        "median_s": t["median_s"],
        "min_s": t["min_s"],
        "bytes_per_s": num_bytes / t["median_s"],
        "best_bytes_per_s": num_bytes / t["min_s"],
    }


def matmul_flops(sizes: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    """FLOP/s of `N x N @ N x N` in bf16 (float32 accumulation) for each N."""
    rows = []
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
        mm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        t = interleaved_times({"matmul": lambda: mm(a, b)}, repeats=repeats)["matmul"]
        flops = 2 * n**3
        rows.append(
            {
                "n": n,
                "median_s": t["median_s"],
                "min_s": t["min_s"],
                "flops_per_s": flops / t["median_s"],
                "best_flops_per_s": flops / t["min_s"],
            }
        )
    return rows


def measure(dry_run: bool) -> dict[str, Any]:
    """Both ceilings; the headline numbers are the best sizes' medians."""
    read_bytes, sizes, repeats = (64 * 2**20, (512,), 3) if dry_run else (4 * GIB, (8192, 16384), 10)
    bandwidth = read_bandwidth(read_bytes, repeats)
    matmuls = matmul_flops(sizes, repeats)
    return {
        "dry_run": dry_run,
        "read_bandwidth": bandwidth,
        "matmul_bf16": matmuls,
        "read_bytes_per_s": bandwidth["bytes_per_s"],
        "bf16_matmul_flops_per_s": max(r["flops_per_s"] for r in matmuls),
    }


def main() -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes (checks the script on CPU)")
    args = parser.parse_args()
    payload = measure(args.cpu_dry_run)
    print(
        f"read {payload['read_bytes_per_s'] / 1e9:.1f} GB/s, bf16 matmul "
        f"{payload['bf16_matmul_flops_per_s'] / 1e12:.1f} TFLOP/s",
        flush=True,
    )
    write_result("device_limits", payload)


if __name__ == "__main__":
    main()
