"""Seconds from typing the command to the first answer token, cold and warm, each in a fresh process.

    python -m bench.startup [--quick] [--repeats 3]

Runs `jaxlongctx generate --model <SmolLM2 GGUF> --chat --prompt ... --max-new-tokens 8` and
`jaxlongctx chat` as a user would, each in its own process, and times from the process start to the
first byte of the answer on standard output (`chat`: to its `>>> ` prompt, then from sending a question
to the first byte of the answer):
- `no cache`: `--no-cache`, what every run cost before the disk cache (GGUF dequantized, every program
  compiled);
- `cold`: an empty cache folder (the first run fills it);
- `warm`: the same folder again (converted weights and compiled programs read back).
The floor is a process that imports jax and numpy and exits, timed in the same run. Writes
bench/results/startup.{json,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, plot_path, save_plot, subplots, use_quick_results, write_result

PROMPT = "What is the capital of France?"
QUESTION = "Name a primary colour."


def _env(cache: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAXLONGCTX_NO_CACHE", "JAXLONGCTX_CACHE_DIR")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    if cache is not None:
        env["JAXLONGCTX_CACHE_DIR"] = str(cache)
    return env


def _read_until(stream: Any, marker: bytes) -> bytes:
    """Read `stream` byte by byte until `marker` (or the end); returns what was read."""
    seen = b""
    while not seen.endswith(marker):
        byte = stream.read(1)
        if not byte:
            break
        seen += byte
    return seen


def generate_first_token(gguf: Path, cache: Path | None) -> dict[str, float]:
    """One `generate --chat` process: seconds to its first stdout byte (the first token) and to its end."""
    flags = [] if cache is not None else ["--no-cache"]
    argv = [sys.executable, "-m", "jaxlongctx.cli", *flags, "generate", "--model", str(gguf), "--chat"]
    argv += ["--prompt", PROMPT, "--max-new-tokens", "8"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    first = proc.stdout.read(1)
    first_s = time.perf_counter() - t0
    rest, err = proc.communicate(timeout=600)
    if proc.returncode != 0 or not first:
        raise SystemExit(f"generate failed ({proc.returncode}): {err.decode()[-2000:]}")
    return {
        "first_token_s": first_s,
        "total_s": time.perf_counter() - t0,
        "answer": (first + rest).decode().strip(),
    }


def chat_ready(cache: Path | None) -> dict[str, float]:
    """One `jaxlongctx chat` process: seconds to its `>>> ` prompt, then from a question to the answer's
    first byte."""
    flags = [] if cache is not None else ["--no-cache"]
    argv = [sys.executable, "-m", "jaxlongctx.cli", *flags, "chat", "--max-new-tokens", "8"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        env=_env(cache),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    if not _read_until(proc.stdout, b">>> ").endswith(b">>> "):
        raise SystemExit(f"chat did not start: {proc.communicate(timeout=60)[1].decode()[-2000:]}")
    ready = time.perf_counter() - t0
    t1 = time.perf_counter()
    proc.stdin.write(QUESTION.encode() + b"\n")
    proc.stdin.flush()
    proc.stdout.read(1)
    answer = time.perf_counter() - t1
    _read_until(proc.stdout, b">>> ")
    proc.stdin.write(b"/exit\n")
    proc.stdin.flush()
    proc.communicate(timeout=60)
    return {"ready_s": ready, "first_token_s": answer}


def import_floor() -> float:
    """Seconds for a process that imports jax and numpy and exits."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import jax, numpy"], check=True, env=_env(None))
    return time.perf_counter() - t0


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs of each kind (default 3)")
    p.add_argument("--quick", action="store_true", help="one run of each kind, _quick result files")
    args = p.parse_args(argv)
    use_quick_results(args.quick)
    repeats = 1 if args.quick else args.repeats
    from bench.common import environment
    from jaxlongctx.pretrained import smollm2_gguf

    gguf = smollm2_gguf()
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("no_cache", "cold", "warm")}
    chats: dict[str, list[dict[str, float]]] = {"no_cache": [], "warm": []}
    floors = []
    with tempfile.TemporaryDirectory(prefix="jaxlongctx-startup-") as tmp:
        for i in range(repeats):  # kinds interleaved, so machine noise hits all alike
            floors.append(import_floor())
            runs["no_cache"].append(generate_first_token(gguf, None))
            cache = Path(tmp) / f"cache{i}"
            runs["cold"].append(generate_first_token(gguf, cache))
            runs["warm"].append(generate_first_token(gguf, cache))
            chats["no_cache"].append(chat_ready(None))
            chats["warm"].append(chat_ready(cache))
            print(
                f"run {i + 1}/{repeats}: "
                + ", ".join(f"{k} {v[-1]['first_token_s']:.1f} s" for k, v in runs.items())
            )
    answers = {r["answer"] for rows in runs.values() for r in rows}
    summary = {
        "generate_first_token_s": {k: _median(v, "first_token_s") for k, v in runs.items()},
        "generate_total_s": {k: _median(v, "total_s") for k, v in runs.items()},
        "chat_ready_s": {k: _median(v, "ready_s") for k, v in chats.items()},
        "chat_first_answer_token_s": {k: _median(v, "first_token_s") for k, v in chats.items()},
        "import_floor_s": statistics.median(floors),
    }
    first = summary["generate_first_token_s"]
    summary["warm_vs_no_cache_speedup"] = first["no_cache"] / first["warm"]
    summary["cold_vs_no_cache_ratio"] = first["cold"] / first["no_cache"]
    payload = {
        "environment": environment(),
        "model": f"SmolLM2-135M-Instruct ({gguf.name}, float32 as generate loads it)",
        "command": f'jaxlongctx generate --model <gguf> --chat --prompt "{PROMPT}" --max-new-tokens 8',
        "repeats": repeats,
        "quick": args.quick,
        "load_average_before_after": [list(load_before), list(os.getloadavg())],
        "answers": sorted(answers),
        **summary,
        "runs": runs,
        "chat_runs": chats,
    }
    write_result("startup", payload)
    plot(summary)
    print(
        f"first token: no cache {first['no_cache']:.1f} s, cold {first['cold']:.1f} s, warm {first['warm']:.1f} s "
        f"(x{summary['warm_vs_no_cache_speedup']:.1f}); chat ready warm {summary['chat_ready_s']['warm']:.1f} s; "
        f"import floor {summary['import_floor_s']:.1f} s"
    )
    return payload


def plot(summary: dict[str, Any]) -> None:
    """Bars of seconds to the first token (generate) and to the prompt (chat), the import floor as a line."""
    fig, ax = subplots(figsize=(7, 3.6))
    labels, values, colours = [], [], []
    for kind, colour in (("no_cache", "tab:gray"), ("cold", "tab:orange"), ("warm", "tab:green")):
        labels.append(f"generate\n{kind.replace('_', ' ')}")
        values.append(summary["generate_first_token_s"][kind])
        colours.append(colour)
    for kind, colour in (("no_cache", "tab:gray"), ("warm", "tab:green")):
        labels.append(f"chat ready\n{kind.replace('_', ' ')}")
        values.append(summary["chat_ready_s"][kind])
        colours.append(colour)
    bars = ax.bar(labels, values, color=colours)
    ax.bar_label(bars, fmt="%.1f s")
    ax.axhline(summary["import_floor_s"], color="k", linestyle=":", label="floor: import jax + numpy")
    ax.set_ylabel("seconds from the command's start")
    ax.set_title("SmolLM2: seconds to the first answer token (median, fresh processes)")
    ax.legend(loc="upper right")
    save_plot(fig, plot_path("startup"))


if __name__ == "__main__":
    main()
