"""pipeline-bench on the simulated device: JSON fields, trace schema, plot."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import child_pids
from tests.e2e.test_faults import cmdline


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable,
        "-m",
        "pipeline.bench",
        "--model",
        "sim",
        "--sim-step-us",
        "2000",
        "--batch-size",
        "1",
        "--input-len",
        "8",
        "--output-len",
        "16",
        "--mode",
        "both",
        "--json",
        str(d / "out.json"),
        "--trace",
        str(d / "trace.json"),
        "--plot",
        str(d / "out.png"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, r.stdout


def test_json_fields_are_consistent(bench_run):
    d, stdout = bench_run
    out = json.loads((d / "out.json").read_text())
    assert "token gap p50" in stdout and "async/sync" in stdout
    for mode in ("async", "sync"):
        r = out[mode]
        gaps = r["token_gap_us"]
        assert set(gaps) == {"p50", "p90", "p99", "max", "mean"}
        assert all(v >= 0 for v in gaps.values())
        assert gaps["p50"] <= gaps["p90"] <= gaps["p99"] <= gaps["max"]
        assert 0 <= r["device_busy_fraction"] <= 1
        assert r["output_tokens_per_s"] > 0
        assert set(r["ttft_ms"]) == {"p50", "p99"} and set(r["itl_ms"]) == {"p50", "p99"}
        # One request: one prefill step that samples the first token, then one decode step per token.
        assert r["num_steps"] == 16
        assert r["output_tokens"] == 16
        assert r["config"]["batch_size"] == 1
        # Host CPU per step of each process, from one `cpu` span per step after the first.
        assert set(r["cpu_per_step_us"]) == {"scheduler", "gpu_worker", "io_proc"}
        assert all(0 <= c["p50"] <= c["p99"] for c in r["cpu_per_step_us"].values())
        # Every step's CPU of the three processes, summed, over the 16 tokens.
        assert r["host_cpu_per_token_us"] > 0
    assert "gpu_worker CPU/step p50 (us)" in stdout and "host CPU per output token (us)" in stdout
    assert out["ratio_async_over_sync"]["output_tokens_per_s"] > 0
    assert (d / "out.png").stat().st_size > 10_000


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_trace_schema(bench_run, mode):
    d, _ = bench_run
    events = json.loads((d / f"trace.{mode}.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["gpu_worker", "io_proc", "scheduler"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {names[e["pid"]] for e in spans} == {"gpu_worker", "io_proc", "scheduler"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    device = sorted((e for e in spans if threads[(e["pid"], e["tid"])] == "device"), key=lambda e: e["args"]["step"])
    assert [e["args"]["step"] for e in device] == list(range(16))
    for a, b in zip(device, device[1:]):
        assert b["ts"] >= a["ts"] + a["dur"] - 1e-3  # monotone, non-overlapping
    counters = [e for e in events if e["ph"] == "C"]
    assert {names[e["pid"]] for e in counters} == {"gpu_worker", "io_proc", "scheduler"}
    assert all(e["args"]["cpu_us"] >= 0 for e in counters)


def test_bound_replays_every_step(tmp_path, tiny_dir):
    """--bound replays exactly the steps the worker ran and reports replay time / wall time."""
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "-m",
        "pipeline.bench",
        "--model",
        str(tiny_dir),
        "--batch-size",
        "3",
        "--input-len",
        "40",
        "--output-len",
        "6",
        "--max-num-batched-tokens",
        "64",
        "--mode",
        "async",
        "--bound",
        "--json",
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["async"]
    bound = res["bound"]
    assert bound["replay_s"] > 0
    assert bound["engine_over_bound"] == pytest.approx(bound["replay_s"] / res["wall_s"])
    assert "engine / bound throughput" in r.stdout


@pytest.mark.parametrize("http", [False, True], ids=["in-process", "http"])
def test_multi_turn_workload(tmp_path, http):
    """Every turn of every user comes back in full; the figures come by turn."""
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "-m",
        "pipeline.bench",
        "--model",
        "sim",
        "--sim-step-us",
        "2000",
        "--workload",
        "multi-turn",
        "--num-users",
        "3",
        "--num-turns",
        "3",
        "--system-len",
        "40",
        "--message-len",
        "5",
        "--output-len",
        "6",
        "--mode",
        "async",
        "--json",
        str(out),
        *(["--http"] if http else []),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["async"]
    assert res["num_requests"] == 9 and res["output_tokens"] == 54
    assert len(res["ttft_p50_ms_by_turn"]) == 3
    assert "TTFT p50 turn 3 (ms)" in r.stdout


def test_structured_workload(tmp_path):
    """Half the requests carry a JSON schema (they end with their JSON, on the simulated device too); the
    workload needs the OpenAI API, so without --http it is refused with the flag to add."""
    out = tmp_path / "out.json"
    base = [sys.executable, "-m", "pipeline.bench", "--model", "sim", "--sim-step-us", "2000"]
    work = ["--workload", "structured", "--num-requests", "4", "--json-share", "0.5", "--output-len", "16"]
    r = subprocess.run([*base, *work], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "add --http" in r.stderr, r.stderr
    cmd = [*base, *work, "--http", "--mode", "async", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["async"]
    assert res["num_requests"] == 4 and 32 < res["output_tokens"] <= 64


def test_a_child_that_dies_stops_the_bench_naming_it():
    """The benchmark watches the processes it started: a scheduler killed mid-run ends it with an error
    naming the scheduler (it used to wait for the dead scheduler's tokens forever)."""
    cmd = [sys.executable, "-m", "pipeline.bench", "--model", "sim", "--sim-step-us", "5000"]
    cmd += ["--batch-size", "4", "--output-len", "100000", "--max-model-len", "200000", "--mode", "async"]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        scheduler = None
        while scheduler is None and time.monotonic() < deadline and bench.poll() is None:
            time.sleep(0.5)
            scheduler = next((p for p in child_pids(bench.pid) if "pipeline-scheduler" in cmdline(p)), None)
        assert scheduler is not None, "the scheduler never started"
        time.sleep(3)  # running the workload
        os.kill(scheduler, signal.SIGKILL)
        _, err = bench.communicate(timeout=30)
    finally:
        for p in child_pids(bench.pid):  # what a bench that did not stop leaves
            os.kill(p, signal.SIGKILL)
        bench.kill()
    assert bench.returncode != 0
    assert "scheduler" in err and "SIGKILL" in err, err[-2000:]
