"""An OpenAI-compatible server in a subprocess on a free port of 127.0.0.1: `jaxlongctx serve` (this
checkout's code) or any other server command, for the server tests and `bench.serve`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`jaxlongctx serve ARGS --port P` in a subprocess (or `command`, a list in which "{port}" is
    replaced), its output in `log`; `devices` > 1 fakes that many CPU devices; `health` is the path
    that answers 200 once it is ready."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        *,
        devices: int = 1,
        startup_s: float = 240,
        command: list[str] | None = None,
        health: str = "/health",
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.health = health
        env = dict(os.environ, PYTHONPATH=str(REPO), JAXLONGCTX_TRACEBACK="1")
        if devices > 1:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        if command is None:
            cmd = [sys.executable, "-m", "jaxlongctx.cli", "serve", "--port", str(self.port), *args]
        else:
            cmd = [part.replace("{port}", str(self.port)) for part in command]
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log_file, stderr=subprocess.STDOUT)
        self.startup_s = startup_s

    def wait_ready(self) -> ServerProcess:
        """Block until the health path answers 200 (raises with the log if the server dies or never answers)."""
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the server did not answer within {self.startup_s} s:\n{self.log.read_text()}")

    def metrics(self) -> dict:
        """GET /metrics (jaxlongctx serve's counters)."""
        return httpx.get(self.url + "/metrics", timeout=10).json()

    def terminate(self) -> None:
        """SIGTERM (the graceful stop)."""
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, wait for the exit (kill after `timeout`); returns the exit status."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode
