"""bench/device_run.py: the GPU programme's one command, kept from rotting by its CPU dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.device_run import Step, main, run
from bench.device_summary import summarize

REPO = Path(__file__).resolve().parent.parent
MEASURED = ("limits", "pytest", "kernels", "armt_schedule", "armt_published", "pq_decode")


@pytest.mark.jaxmin  # the GPU image's jax: the one the device run meets
@pytest.mark.jaxmin_lane  # a minute and a half: CI runs it once, in that lane
def test_cpu_dry_run_runs_every_step(tmp_path):
    """The documented command, at toy sizes: every step passes and the summary holds every ratio."""
    out = tmp_path / "gpu"
    proc = subprocess.run(
        [sys.executable, "bench/device_run.py", "--out", str(out), "--cpu-dry-run"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "gpu_summary.json").read_text())
    assert summary["environment"]["cpu_dry_run"] is True
    assert summary["environment"]["jax_backend"] == "cpu"
    assert {name: s["status"] for name, s in summary["steps"].items()} == {
        **{name: "ok" for name in MEASURED},
        "real_model": "skipped",
    }
    for name in MEASURED:
        record = json.loads((out / f"gpu_{name}.json").read_text())
        assert record["results"], name
        assert (out / "logs" / f"{name}.log").is_file()
    assert summary["ceilings"]["read_bytes_per_s"] > 0 and summary["ceilings"]["bf16_matmul_flops_per_s"] > 0
    counts = summary["gpu_tests"]
    assert (
        counts["skipped"] > 0 and counts["passed"] == counts["failure"] == counts["error"] == 0
    )  # no GPU here
    ratios = summary["ratios"]
    assert not any("error" in part for part in ratios.values()), ratios
    ok, total = ratios["kernels"]["correctness_ok"].split("/")
    assert ok == total and int(total) > 0
    armt = ratios["armt_schedule"]["rows"][0]
    for method in ("diagonal/vmap", "diagonal/grouped_matmul"):
        assert armt[f"{method}_speedup_over_sequential"] > 0 and armt[f"{method}_fraction_of_matmul_peak"] > 0
    published = ratios["armt_published"]["rows"][0]  # sink + sliding window, vs full attention
    assert (
        published["diagonal/grouped_matmul_speedup_over_sequential"] > 0
        and published["full_over_diagonal"] > 0
    )
    assert published["state_bytes"] > 0 and published["full_attention_kv_bytes"] > 0
    pq = ratios["pq_decode"]["rows"][0]
    assert pq["dense_over_pq_ds4"] > 0 and pq["dense_over_pq_ds4_4bit"] > 0  # 8-bit codes, 4-bit packed
    assert pq["pq_ds4_fraction_of_bandwidth"] > 0 and pq["pq_ds4_4bit_fraction_of_bandwidth"] > 0
    assert set(summary["goals"]) == {
        "diagonal_over_sequential",
        "pq_attention_over_bf16",
        "grouped_gemm_vs_ragged_dot",
    }
    assert sorted(p.name for p in out.glob("gpu_*.png")) == [
        "gpu_armt_published.png",
        "gpu_armt_schedule.png",
        "gpu_kernels.png",
        "gpu_pq_decode.png",
    ]


def test_decode_bytes_count_packed_codes_at_half_a_byte():
    from bench.device_summary import decode_bytes

    model = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 64, "hidden_size": 256}
    model |= {"intermediate_size": 512, "num_heads": 4, "vocab_size": 1000}
    weights = decode_bytes(model, 0, 2, sub_dim=2)
    eight = decode_bytes(model, 1000, 2, sub_dim=2, window=128) - weights  # 32 codes a byte each
    four = decode_bytes(model, 1000, 2, sub_dim=2, window=128, code_bits=4) - weights
    window = 2 * 2 * 4 * 128 * 64 * 2
    assert eight - window == 2 * 2 * 4 * 1000 * 32 and four - window == 2 * 2 * 4 * 1000 * 16


def test_failed_and_timed_out_steps_are_recorded_and_the_rest_run(tmp_path):
    plan = [
        Step("fails", ("bench.no_such_bench",), None, 30),
        Step("sleeps", ("timeit", "-n1", "-r1", "import time; time.sleep(60)"), None, 2),
        Step("absent", ("platform",), None, 30, needs="bench/no_such_file.py"),
        Step("runs", ("platform",), None, 30),
    ]
    (tmp_path / "out").mkdir()
    summary = run(tmp_path / "out", plan, dry_run=False, budget_s=120, env=dict(os.environ))
    steps = summary["steps"]
    assert steps["fails"]["status"] == "failed" and steps["fails"]["returncode"] != 0
    assert steps["sleeps"]["status"] == "timeout" and steps["sleeps"]["seconds"] < 30
    assert steps["absent"] == {"status": "skipped", "reason": "bench/no_such_file.py is not in this checkout"}
    assert steps["runs"]["status"] == "ok"
    assert (
        "No module named bench.no_such_bench"
        in json.loads((tmp_path / "out" / "gpu_fails.json").read_text())["output_tail"]
    )
    assert all("error" in part for part in summary["ratios"].values())  # no numbers: reported, not raised


def test_steps_past_the_budget_are_skipped(tmp_path):
    (tmp_path / "out").mkdir()
    summary = run(
        tmp_path / "out",
        [Step("late", ("platform",), None, 30)],
        dry_run=False,
        budget_s=1,
        env=dict(os.environ),
    )
    assert (
        summary["steps"]["late"]["status"] == "skipped"
        and "out of time" in summary["steps"]["late"]["reason"]
    )


def test_refuses_an_output_that_is_not_ours(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # main sets it for its own process; undone after the test
    (tmp_path / "taken").mkdir()
    assert main(["--out", str(tmp_path / "taken"), "--only", "limits"]) == 2
    assert "output already exists (pass --overwrite" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "taken"), "--only", "limits", "--overwrite"]) == 2
    assert "not written by jaxlongctx" in capsys.readouterr().err
    assert main(["--out", str(REPO), "--only", "limits", "--overwrite"]) == 2  # the repository is an input
    assert "is or contains the input" in capsys.readouterr().err


def test_summary_of_partial_results_reports_errors():
    summary = summarize({"limits": {"status": "timeout", "results": {}}}, {"cpu_dry_run": True})
    assert summary["steps"] == {"limits": {"status": "timeout"}}
    assert "error" in summary["ceilings"] and summary["goals"] == {}


def test_needs_the_repository_on_the_import_path(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "device_run.py"), "--out", str(tmp_path / "x")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "PYTHONPATH=. python3 bench/device_run.py" in proc.stderr
    assert not (tmp_path / "x").exists()
