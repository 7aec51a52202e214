"""--worker-cpus and --frontend-cpus put each process on its CPUs, and the server still serves."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1"
)


def test_processes_run_on_their_cpus(tiny_dir):
    server = Server(["--model", str(tiny_dir), "--worker-cpus", "1", "--frontend-cpus", "0", "--worker-threads", "1"])
    try:
        roles = {}
        for pid in server.children:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for role in ("gpu_worker", "scheduler", "io_proc"):
                if f"pipeline-{role}" in cmd:
                    roles[role] = pid
        assert set(roles) == {"gpu_worker", "scheduler", "io_proc"}
        assert os.sched_getaffinity(roles["gpu_worker"]) == {1}
        assert os.sched_getaffinity(roles["scheduler"]) == {0}
        assert os.sched_getaffinity(roles["io_proc"]) == {0}
        r = httpx.post(
            f"{server.url}/v1/completions",
            timeout=120,
            json={"model": server.model, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
