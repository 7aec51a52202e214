"""The benchmark scripts' server handling: a free port, waiting for ``/health``, ``pipeline-serve`` in a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, poll_s: float = 0.5) -> bool:
    """Poll ``url``/health until it answers 200 (True), ``proc`` exits or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def child_pid(pid: int, name: str) -> int:
    """The child of ``pid`` whose command line contains ``name`` (``scheduler``, ``io_proc``, ...)."""
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return next(int(k) for k in kids if name in open(f"/proc/{k}/cmdline").read())


class Server:
    """``pipeline-serve`` in a subprocess on ``port`` (default: a free one), ready once ``/health`` is 200."""

    def __init__(self, flags: list[str], port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pipeline.launcher", "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(cmd, cwd=REPO)
        if not wait_healthy(self.url, self.proc, 600):
            self.stop()
            raise SystemExit("the server did not start")
        self.model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]
        self._pids: dict[str, int] = {}

    def rss_mb(self, name: str = "scheduler") -> float:
        """Resident MiB of the server's process ``name``."""
        pid = self._pids.setdefault(name, child_pid(self.proc.pid, name))
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    def stop(self) -> None:
        stop_process(self.proc, 30)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM ``proc``, then SIGKILL it if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
