"""Starting and stopping leaves no process and no shared-memory segment behind."""

from __future__ import annotations

import os
import signal
import time

from tests.conftest import SMALL, Server, child_pids, shm_entries


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_three_processes_and_sigterm_cleans_up(tiny_dir):
    srv = Server(["--model", str(tiny_dir), *SMALL])
    titles = []
    for pid in srv.children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            titles.append(f.read().decode(errors="replace"))
    roles = {r for r in ("io_proc", "scheduler", "gpu_worker") for t in titles if f"pipeline-{r}" in t}
    assert roles == {"io_proc", "scheduler", "gpu_worker"}, titles
    assert shm_entries(srv.proc.pid) == []  # unlinked once everyone attached
    t0 = time.monotonic()
    assert srv.stop(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 10
    assert wait_gone(srv.children) == []
    assert shm_entries(srv.proc.pid) == []


def test_kill_worker_stops_everything(tiny_dir):
    srv = Server(["--model", str(tiny_dir), *SMALL])
    worker = next(p for p in srv.children if b"pipeline-gpu_worker" in open(f"/proc/{p}/cmdline", "rb").read())
    os.kill(worker, signal.SIGKILL)
    code = srv.proc.wait(15)
    out = srv.output()
    assert code != 0
    assert "gpu_worker" in out and "SIGKILL" in out, out
    # No multiprocessing resource tracker runs, so none warns of "leaked" semaphores.
    assert "leaked" not in out and "resource_tracker" not in out, out
    assert wait_gone(srv.children) == []
    assert shm_entries(srv.proc.pid) == []
    assert child_pids(srv.proc.pid) == []


def test_serve_trace_has_three_process_tracks(tmp_path):
    import json

    import httpx

    trace = tmp_path / "serve-trace.json"
    srv = Server(["--model", "sim", "--sim-step-us", "1000", "--trace", str(trace)])
    r = httpx.post(
        f"{srv.url}/v1/completions",
        timeout=60,
        json={"model": srv.model, "prompt": "hello", "max_tokens": 8, "ignore_eos": True},
    )
    assert r.status_code == 200
    assert srv.stop(signal.SIGTERM) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    pids = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {pids[e["pid"]] for e in events if e["ph"] == "X"} == {"scheduler", "gpu_worker", "io_proc"}
    assert shm_entries(srv.proc.pid) == []
