"""The whole GPU programme in one command, for a lent device: each step time-boxed, results saved as it goes.

    PYTHONPATH=. python3 bench/device_run.py --out DIR          # on the GPU machine, from the repository root
    PYTHONPATH=. python3 bench/device_run.py --out DIR --cpu-dry-run   # the same steps at toy sizes on CPU

Every step is a subprocess (`python -m ...`) with its own time limit and its own results folder
(JAXLONGCTX_BENCH_RESULTS); a step that fails or runs out of time is recorded and the next one runs.
DIR (written through `atomic_directory`; while the run is going, or if it is killed, the files lie in
its hidden sibling `.DIR.jaxlongctx-tmp-*`) receives, as each step ends:
  gpu_limits.json        memory read bandwidth and bf16 matmul FLOP/s, measured in the same run
  gpu_pytest.json        `pytest -m gpu`: the real Pallas kernels against their references
  gpu_kernels.json       grouped GEMM vs einsum / ragged_dot, PQ decode attention vs bf16 attention (1K-32K)
  gpu_armt_schedule.json ARMT diagonal (vmapped cell, grouped-GEMM kernel) vs sequential, Llama-3.2-1B shape, 16K-128K
  gpu_armt_published.json the published ARMT cell (sink, sliding window, 32 memory tokens) at that shape:
                         diagonal vs sequential vs full attention, 16K-128K, state bytes per row
  gpu_pq_decode.json     dense vs PQ decode per token at 32K (Llama-2-7B shape, bf16; 8- and 4-bit codes)
  gpu_real_model.json    SmolLM2 prefill and decode (when bench/real_model.py exists)
  gpu_summary.json       every ratio beside the fraction of the measured ceiling, the goals, device and versions
plus each bench's PNG as gpu_<step>.png and every step's full output under logs/. The parent process
never touches the accelerator (it runs with JAX_PLATFORMS=cpu), so each step has the device to itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
GPU_BUDGET_S = 560  # the whole run, under the 10 minutes one device command can run
DRY_RUN_STEP_S = 300  # a CPU dry-run step's limit (toy sizes, but compiles are slow on 2 cores)
MIN_STEP_S = 15  # a step with less time left than this is skipped, not started
TAIL_CHARS = 4000


@dataclasses.dataclass(frozen=True)
class Step:
    """One time-boxed subprocess: `args` after `python -m`, on the GPU or in the CPU dry run (None: a
    step with no toy size, skipped there)."""

    name: str
    gpu_args: tuple[str, ...]
    dry_args: tuple[str, ...] | None
    timeout_s: int  # on the GPU
    needs: str | None = None  # a repository file the step runs only if present


def gpu_test_files() -> tuple[str, ...]:
    """Test files holding `@pytest.mark.gpu` tests (collecting only these keeps the step short)."""
    return tuple(
        sorted(
            str(p.relative_to(REPO_ROOT))
            for p in (REPO_ROOT / "tests").glob("test_*.py")
            if "pytest.mark.gpu" in p.read_text()
        )
    )


def steps() -> list[Step]:
    """The programme, most important numbers first after the ceilings and the kernels' correctness."""
    pytest = ("pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider", *gpu_test_files())
    return [
        Step("limits", ("bench.device_limits",), ("bench.device_limits", "--cpu-dry-run"), 30),
        Step("pytest", pytest, pytest, 60),
        Step("kernels", ("bench.gpu_kernels", "--quick"), ("bench.gpu_kernels", "--dry-run-cpu"), 100),
        Step(
            "armt_schedule",
            ("bench.armt_schedule", "--sweep", "device"),
            ("bench.armt_schedule", "--sweep", "device_dry_run"),
            150,
        ),
        Step(
            "armt_published",
            ("bench.armt_schedule", "--sweep", "published_device"),
            ("bench.armt_schedule", "--sweep", "published_device_dry_run"),
            120,
        ),
        Step(
            "pq_decode",
            ("bench.pq_decode", "--contexts", "32768", "--bits", "8,4"),
            (
                "bench.pq_decode",
                "--contexts",
                "256",
                "--steps",
                "2",
                "--repeats",
                "1",
                "--ds",
                "4",
                "--bits",
                "8,4",
            ),
            90,
        ),
        # the real SmolLM2 has no toy size (its CPU runs are bench.real_model's own, minutes long)
        Step("real_model", ("bench.real_model", "--quick"), None, 40, needs="bench/real_model.py"),
    ]


# ---------------------------------------------------------------- running one step


def run_step(
    step: Step, out: Path, *, dry_run: bool, timeout_s: float, env: dict[str, str]
) -> dict[str, Any]:
    """Run `step` in its own process group with a time limit; returns its record (results included)."""
    work = out / "work" / step.name
    work.mkdir(parents=True)
    args = step.dry_args if dry_run else step.gpu_args
    if step.name == "pytest":
        args = (*args, f"--junitxml={work / 'junit.xml'}")
    command = [sys.executable, "-m", *args]
    log_path = out / "logs" / f"{step.name}.log"
    record: dict[str, Any] = {
        "step": step.name,
        "command": " ".join(command[1:]),
        "timeout_s": round(timeout_s),
    }
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**env, "JAXLONGCTX_BENCH_RESULTS": str(work)},
        )
        try:
            record["returncode"] = proc.wait(timeout=timeout_s)
            record["status"] = "ok" if record["returncode"] == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the step's whole process group, nothing else
            proc.wait()
            record.update(returncode=None, status="timeout")
    record["seconds"] = round(time.perf_counter() - t0, 1)
    record["cpu_s"] = round(_children_cpu_s() - cpu0, 1)  # user + system of the step's processes
    record["output_tail"] = log_path.read_text(errors="replace")[-TAIL_CHARS:]
    record["results"] = {p.stem: json.loads(p.read_text()) for p in sorted(work.glob("*.json"))}
    if step.name == "pytest" and (work / "junit.xml").is_file():
        record["results"]["pytest"] = junit_summary(work / "junit.xml")
    pngs = sorted(work.glob("*.png"))
    for png in pngs:
        shutil.copy(
            png, out / (f"gpu_{step.name}.png" if len(pngs) == 1 else f"gpu_{step.name}_{png.stem}.png")
        )
    shutil.rmtree(work)
    work.parent.rmdir()
    return record


def _children_cpu_s() -> float:
    """User + system seconds of every finished child process so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts and per-test outcomes of a pytest JUnit XML report."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = child.tag, (child.get("message") or "")[:300]
        cases.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message,
            }
        )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
    return {"counts": counts, "tests": cases}


def skipped(step: Step, reason: str) -> dict[str, Any]:
    """The record of a step that did not start."""
    return {"step": step.name, "status": "skipped", "reason": reason, "results": {}}


# ---------------------------------------------------------------- environment


def nvidia_smi() -> dict[str, Any] | None:
    """GPU name, memory, driver and CUDA versions from nvidia-smi (None where it is absent)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        query = subprocess.run(
            [exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        header = subprocess.run([exe], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": str(e)}
    cuda = header.split("CUDA Version:")[1].split()[0] if "CUDA Version:" in header else None
    gpus = [
        dict(zip(("name", "memory_total", "driver_version"), (x.strip() for x in line.split(","))))
        for line in query.splitlines()
    ]
    return {"gpus": gpus, "cuda_version": cuda}


def package_versions() -> dict[str, str | None]:
    """Versions of the packages the results depend on, read without importing them."""
    names = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "flax", "numpy")
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


# ---------------------------------------------------------------- the run


def run(
    out: Path, plan: list[Step], *, dry_run: bool, budget_s: float, env: dict[str, str]
) -> dict[str, Any]:
    """Run the steps of `plan` in order (environment `env`) into `out`, an empty folder, writing
    gpu_<step>.json after each; returns the summary."""
    from bench.device_summary import summarize

    (out / "logs").mkdir()
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), env.get("PYTHONPATH"))))}
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    deadline = time.monotonic() + budget_s
    records: dict[str, dict[str, Any]] = {}
    for step in plan:
        left = deadline - time.monotonic()
        if step.needs and not (REPO_ROOT / step.needs).is_file():
            record = skipped(step, f"{step.needs} is not in this checkout")
        elif dry_run and step.dry_args is None:
            record = skipped(step, "no toy size for the CPU dry run")
        elif not dry_run and left < MIN_STEP_S:
            record = skipped(step, f"out of time ({left:.0f} s of the {budget_s:.0f} s budget left)")
        else:
            timeout = DRY_RUN_STEP_S if dry_run else min(step.timeout_s, left)
            print(f"[device_run] {step.name}: up to {timeout:.0f} s", flush=True)
            record = run_step(step, out, dry_run=dry_run, timeout_s=timeout, env=env)
        print(f"[device_run] {step.name}: {record['status']} ({record.get('seconds', 0)} s)", flush=True)
        records[step.name] = record
        write_json(out / f"gpu_{step.name}.json", record)
    environment = {
        "cpu_dry_run": dry_run,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": package_versions(),
        "nvidia_smi": nvidia_smi(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    summary = summarize(records, environment)
    write_json(out / "gpu_summary.json", summary)
    return summary


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write `payload` as indented JSON, atomically (a killed run leaves whole files only)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit code 0 when every step that ran passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", required=True, type=Path, help="output folder (new, or ours with --overwrite)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier device run's folder")
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same steps at toy sizes on CPU")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=GPU_BUDGET_S,
        help=f"time for the whole GPU run (default {GPU_BUDGET_S}); steps past it are skipped",
    )
    parser.add_argument("--only", default="", help="comma-separated step names to run (default: all)")
    args = parser.parse_args(argv)
    names = [s.name for s in steps()]
    only = tuple(filter(None, args.only.split(",")))
    if unknown := sorted(set(only) - set(names)):
        parser.error(f"--only: unknown steps {', '.join(unknown)} (steps: {', '.join(names)})")
    if not any(Path(entry or ".").resolve() == REPO_ROOT for entry in sys.path):
        print(
            "error: the repository is not on the import path; from its root run "
            "`PYTHONPATH=. python3 bench/device_run.py ...` or `python3 -m bench.device_run ...`",
            file=sys.stderr,
        )
        return 2
    step_env = dict(os.environ)
    os.environ["JAX_PLATFORMS"] = "cpu"  # before anything imports jax: the accelerator is the steps' alone
    from jaxlongctx.output_dir import OutputError, atomic_directory

    try:
        with atomic_directory(
            args.out, overwrite=args.overwrite, kind="device-run", inputs=(REPO_ROOT,)
        ) as tmp:
            print(f"[device_run] writing into {tmp} (renamed to {args.out} at the end)", flush=True)
            summary = run(
                tmp,
                [s for s in steps() if not only or s.name in only],
                dry_run=args.cpu_dry_run,
                budget_s=args.budget_s,
                env=step_env,
            )
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = [name for name, s in summary["steps"].items() if s["status"] in ("failed", "timeout")]
    print(
        f"[device_run] wrote {args.out}: "
        + ", ".join(f"{k} {v['status']}" for k, v in summary["steps"].items())
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
