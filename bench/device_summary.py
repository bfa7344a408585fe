"""The device run's summary: every peer ratio beside the fraction of the measured ceiling, and the goals.

`summarize(records, environment)` reads the step records of bench/device_run.py (each holding the
JSON its bench wrote, possibly partial) and never raises: a part whose numbers are missing or
malformed is reported as `{"error": ...}`. Ratios are "how many times faster": peer time / our time.

Goals on an H200 (issue 39): ARMT diagonal >= 2x sequential at 128K tokens (1B shape); PQ attention
>= 2x bf16 attention at 32K; the grouped GEMM within 10% of `ragged_dot` or better.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pallas_kernels.pq_codes import code_bytes

GOAL_DIAGONAL_SPEEDUP = 2.0
GOAL_PQ_ATTENTION_SPEEDUP = 2.0
GOAL_GEMM_SLOWDOWN = 1.10  # grouped GEMM time at most this times ragged_dot's
STEP_FIELDS = (
    "status",
    "seconds",
    "cpu_s",
    "timeout_s",
    "returncode",
    "reason",
)  # of each step in the summary


def only_result(record: dict[str, Any] | None) -> dict[str, Any]:
    """The single bench payload of a step record (KeyError when the step wrote none)."""
    results = (record or {}).get("results") or {}
    payloads = [v for k, v in results.items() if k != "pytest"]
    if len(payloads) != 1:
        raise KeyError(f"expected one result, found {sorted(results)}")
    return payloads[0]


def layer_matmul_params(model: dict[str, Any]) -> int:
    """Weights one decoder layer multiplies by (q, k, v, o and the gated MLP)."""
    d, hd, inter = model["hidden_size"], model["head_dim"], model["intermediate_size"]
    return d * hd * (model["num_heads"] * 2 + model["num_kv_heads"] * 2) + 3 * d * inter


def ceilings(limits: dict[str, Any]) -> dict[str, float]:
    """Measured read bandwidth (bytes/s) and bf16 matmul rate (FLOP/s)."""
    return {key: limits[key] for key in ("read_bytes_per_s", "bf16_matmul_flops_per_s")}


def kernel_ratios(payload: dict[str, Any], ceil: dict[str, float]) -> dict[str, Any]:
    """Grouped GEMM vs einsum / ragged_dot, and PQ decode attention vs bf16 attention."""
    flops_peak, bandwidth = ceil.get("bf16_matmul_flops_per_s"), ceil.get("read_bytes_per_s")
    gemm = []
    for row in payload.get("grouped_matmul", []):  # absent when the step ran out of time
        tflops = row["active_tflops"]
        gemm.append(
            {
                "projection": row["projection"],
                "num_active": row["num_active"],
                "einsum_over_pallas": row["time_over_pallas"]["einsum"],
                "ragged_dot_over_pallas": row["time_over_pallas"]["ragged_dot"],
                "fwd_bwd_einsum_over_pallas": row["fwd_bwd_einsum_over_pallas"],
                **(
                    {f"{m}_fraction_of_matmul_peak": tflops[m] * 1e12 / flops_peak for m in tflops}
                    if flops_peak
                    else {}
                ),
            }
        )
    attention = []
    for row in payload.get("pq_decode_attention", []):
        times = {m: t["median_s"] for m, t in row["times"].items()}
        entry = {
            "context": row["context"],
            **{f"{m}_speedup_over_bf16": v for m, v in row["exact_bf16_over_pq"].items()},
        }
        if bandwidth:
            entry["exact_bf16_fraction_of_bandwidth"] = row["exact_bytes"] / times["exact_bf16"] / bandwidth
            for ds, code_bytes in row["pq_code_bytes"].items():
                entry[f"pq_pallas_{ds}_fraction_of_bandwidth"] = (
                    code_bytes / times[f"pq_pallas_{ds}"] / bandwidth
                )
        attention.append(entry)
    checks = payload["correctness"]
    return {
        "complete": payload.get("complete", False),
        "grouped_matmul": gemm,
        "pq_decode_attention": attention,
        "correctness_ok": f"{sum(c['ok'] for c in checks)}/{len(checks)}",
    }


def armt_ratios(payload: dict[str, Any], ceil: dict[str, float]) -> dict[str, Any]:
    """Per length and ARMT config: sequential time over each diagonal variant's, and projection FLOP/s
    as a fraction of the matmul peak (projections only; attention and memory updates not counted)."""
    model, peak = payload["config"]["model"], ceil.get("bf16_matmul_flops_per_s")
    rows = []
    for row in payload["rows"]:
        for key in row:
            if "/" not in key or not isinstance(row[key], dict):
                continue  # "seg/mem" entries only
            seg, mem = (int(x) for x in key.split("/"))
            cells = row[key]["segments"] * model["num_layers"]
            flops = 2 * layer_matmul_params(model) * (seg + mem) * cells
            seq = row["times"][f"sequential {key}"]["median_s"]
            entry: dict[str, Any] = {
                "length": row["length"],
                "armt": key,
                "state_bytes": row[key]["state_bytes"],
            }
            if "full" in row["times"]:
                entry["full_over_diagonal"] = row[key]["full_vs_diagonal"]
                entry["full_attention_kv_bytes"] = row["full_attention_kv_bytes"]
            for name, t in row["times"].items():
                if not name.endswith(f" {key}"):
                    continue
                method = name.split()[0]
                if method != "sequential":
                    entry[f"{method}_speedup_over_sequential"] = seq / t["median_s"]
                if peak:
                    entry[f"{method}_fraction_of_matmul_peak"] = flops / t["median_s"] / peak
            rows.append(entry)
    return {"complete": payload.get("complete", False), "rows": rows}


def decode_bytes(
    model: dict[str, Any],
    context: int,
    dtype_bytes: int,
    *,
    sub_dim: int | None = None,
    window: int = 0,
    code_bits: int = 8,
) -> int:
    """Bytes one decode step reads: every layer's weights, the head, and the cache (dense, or PQ
    codes `[L K T M]` uint8, two a byte where `code_bits` <= 4, plus the exact window when `sub_dim`
    is given)."""
    L, K, hd = model["num_layers"], model["num_kv_heads"], model["head_dim"]
    weights = (L * layer_matmul_params(model) + model["vocab_size"] * model["hidden_size"]) * dtype_bytes
    if sub_dim is None:
        return weights + 2 * L * K * context * hd * dtype_bytes
    codes = code_bytes(2**code_bits, hd // sub_dim)
    return weights + 2 * L * K * (context * codes + window * hd * dtype_bytes)


def pq_decode_ratios(payload: dict[str, Any], ceil: dict[str, float]) -> dict[str, Any]:
    """Dense over PQ time per token (and with the window flush amortized), with each side's bytes
    read per token as a fraction of the measured bandwidth."""
    cfg, bandwidth = payload["config"], ceil.get("read_bytes_per_s")
    model, dtype_bytes = cfg["model_config"], 2 if cfg["dtype"] == "bfloat16" else 4
    rows = []
    for row in payload["timing"]:
        entry = {"context": row["context"], **{k: v for k, v in row.items() if k.startswith("dense_over_pq")}}
        if bandwidth:
            entry["dense_fraction_of_bandwidth"] = (
                decode_bytes(model, row["context"], dtype_bytes) / row["dense_s_per_token"] / bandwidth
            )
            for key in row:
                if key.startswith("pq_ds") and key.endswith("_s_per_token") and "amortized" not in key:
                    name = key.removesuffix("_s_per_token")
                    shape = cfg["pq_caches"][name]  # {"ds", "bits"}
                    read = decode_bytes(
                        model,
                        row["context"],
                        dtype_bytes,
                        sub_dim=shape["ds"],
                        window=cfg["window"],
                        code_bits=shape["bits"],
                    )
                    entry[f"{name}_fraction_of_bandwidth"] = read / row[key] / bandwidth
        rows.append(entry)
    return {"rows": rows}


def goals(ratios: dict[str, Any]) -> dict[str, Any]:
    """The three H200 goals, judged at the largest length / context measured (named in `at`)."""
    out: dict[str, Any] = {}
    armt = [r for r in ratios.get("armt_schedule", {}).get("rows", [])]
    if armt:
        last = max(armt, key=lambda r: r["length"])
        best = max((v for k, v in last.items() if k.endswith("_speedup_over_sequential")), default=None)
        out["diagonal_over_sequential"] = {
            "at": last["length"],
            "goal": GOAL_DIAGONAL_SPEEDUP,
            "value": best,
            "met": best is not None and best >= GOAL_DIAGONAL_SPEEDUP,
        }
    attention = ratios.get("kernels", {}).get("pq_decode_attention", [])
    if attention:
        last = max(attention, key=lambda r: r["context"])
        best = max(
            (v for k, v in last.items() if k.startswith("pq_pallas") and k.endswith("_speedup_over_bf16")),
            default=None,
        )
        out["pq_attention_over_bf16"] = {
            "at": last["context"],
            "goal": GOAL_PQ_ATTENTION_SPEEDUP,
            "value": best,
            "met": best is not None and best >= GOAL_PQ_ATTENTION_SPEEDUP,
        }
    gemm = ratios.get("kernels", {}).get("grouped_matmul", [])
    if gemm:
        worst = min(r["ragged_dot_over_pallas"] for r in gemm)
        out["grouped_gemm_vs_ragged_dot"] = {
            "worst_ragged_dot_over_pallas": worst,
            "goal": 1 / GOAL_GEMM_SLOWDOWN,
            "met": worst >= 1 / GOAL_GEMM_SLOWDOWN,
        }
    return out


def guarded(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`fn(*args)`, or `{"error": ...}` when the numbers it needs are missing or malformed."""
    try:
        return fn(*args)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError, IndexError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def summarize(records: dict[str, dict[str, Any]], environment: dict[str, Any]) -> dict[str, Any]:
    """The summary JSON: step statuses, device and versions, ceilings, ratios and goals."""
    limits = guarded(lambda: only_result(records.get("limits")))
    ceil = guarded(ceilings, limits)
    ratios = {
        "kernels": guarded(lambda: kernel_ratios(only_result(records.get("kernels")), ceil)),
        "armt_schedule": guarded(lambda: armt_ratios(only_result(records.get("armt_schedule")), ceil)),
        "armt_published": guarded(lambda: armt_ratios(only_result(records.get("armt_published")), ceil)),
        "pq_decode": guarded(lambda: pq_decode_ratios(only_result(records.get("pq_decode")), ceil)),
    }
    real = (records.get("real_model") or {}).get("results")
    if real:
        ratios["real_model"] = {k: v.get("summary", v) for k, v in real.items()}
    pytest = ((records.get("pytest") or {}).get("results") or {}).get("pytest", {}).get("counts")
    return {
        "steps": {name: {k: r[k] for k in STEP_FIELDS if k in r} for name, r in records.items()},
        "environment": {
            **environment,
            "jax_devices": limits.get("environment", {}).get("devices"),
            "jax_backend": limits.get("environment", {}).get("backend"),
        },
        "ceilings": ceil,
        "gpu_tests": pytest,
        "ratios": ratios,
        "goals": goals(ratios),
    }
