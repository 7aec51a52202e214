"""Starting and stopping leaves no process and no shared-memory segment behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import REPO, SMALL, Server, child_pids, free_port, shm_entries


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


def _complete(url: str, model: str, results: list) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 1}, timeout=600)
    results.append((time.monotonic(), r.status_code, r.json()))


@pytest.mark.slow
def test_health_is_503_until_a_request_can_be_served(tiny_dir, tmp_path):
    """With the attention kernel not built yet (an empty cache), /health answers 503 while the worker compiles
    it; its first 200 comes with the launcher's ready line, and a 1-token request is then served within 2 s.
    A request sent during start-up waits and is served: the step timeout (3 s, shorter than the compile)
    counts from the worker's start."""
    port = free_port()
    env = {**os.environ, "PIPELINE_CACHE_DIR": str(tmp_path)}
    args = [sys.executable, "-m", "pipeline.launcher", "--port", str(port), "--model", str(tiny_dir), *SMALL]
    proc = subprocess.Popen(
        [*args, "--step-timeout", "3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
    )
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), ln) for ln in proc.stdout), daemon=True)
    reader.start()
    url, unready, early, served = f"http://127.0.0.1:{port}", [], [], []
    early_request = None
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(ln for _, ln in lines)
            try:
                r = httpx.get(f"{url}/health", timeout=5)
            except httpx.HTTPError:  # not listening yet
                time.sleep(0.05)
                continue
            if r.status_code == 200:
                break
            assert r.status_code == 503, r.text
            unready.append(r.json()["error"])
            if early_request is None:
                model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
                early_request = threading.Thread(target=_complete, args=(url, model, early))
                early_request.start()
            time.sleep(0.05)
        first_200 = time.monotonic()
        _complete(url, model, served)
        early_request.join(600)
        assert proc.poll() is None, "".join(ln for _, ln in lines)
    finally:
        proc.terminate()
        proc.wait(30)
    assert unready, "io_proc listened only once the engine was ready: the compile window went untested"
    starting = re.compile(r"^the server is starting: (scheduler, )?gpu_worker not ready yet \(loading the model")
    assert all(e["type"] == "service_unavailable_error" and starting.match(e["message"]) for e in unready), unready
    (done, status, body), (_, early_status, early_body) = served[0], early[0]
    assert status == 200 and body["usage"]["completion_tokens"] == 1, body
    assert done - first_200 < 2.0
    assert early_status == 200 and early_body["usage"]["completion_tokens"] == 1, early_body
    ready_lines = [t for t, ln in lines if "ready in" in ln]
    assert len(ready_lines) == 1 and abs(ready_lines[0] - first_200) < 2.0
    assert len(list(tmp_path.glob("kernels/*.so"))) == 1  # compiled in this start, not found in a cache
