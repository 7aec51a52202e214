"""``-tp 2`` (two gloo worker ranks) serves exactly what one rank serves.

The tiny Llama with 4 KV heads, a 32-token step budget (chunked prefill) and
a KV cache small enough to force preemption (24 blocks), poison mode on: greedy and
seeded sampled tokens of ``-tp 2`` in async and lock step must equal those of
a single-rank lock-step server token for token (float32). A ``kill -9`` of
rank 1 under load stops the server naming the rank, and a ``-tp 2`` trace has
a track per rank.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from tests.conftest import Server, child_pids, load_until_generating, shm_entries, tcp_sockets
from tests.e2e.test_async import run_all
from tests.e2e.test_lifecycle import wait_gone

BASE = ["--max-num-batched-tokens", "32", "--max-model-len", "256", "--debug-token-cache-poison"]


def jobs() -> list[dict]:
    """Prompts that overflow 24 KV blocks together, greedy and seeded-sampled."""
    out = [{"prompt": f"{i}: " + "the of and " * (10 + 8 * i), "max_tokens": 16, "abort_after": None} for i in range(8)]
    out += [
        {
            "prompt": f"sampled {i}: " + "was for on " * (5 + 8 * i),
            "max_tokens": 16,
            "abort_after": None,
            "sampling": {"temperature": 1.0, "top_p": 0.9, "seed": 7 + i},
        }
        for i in range(6)
    ]
    return out


@pytest.fixture(scope="module")
def reference(tiny_kv4_dir):
    srv = Server(["--model", str(tiny_kv4_dir), *BASE, "--num-kv-blocks", "200", "--no-async-scheduling"])
    try:
        yield asyncio.run(run_all(srv, jobs()))
    finally:
        srv.stop()


@pytest.mark.parametrize("mode", ["--async-scheduling", "--no-async-scheduling"])
def test_tp2_equals_tp1(tiny_kv4_dir, reference, mode):
    srv = Server(["--model", str(tiny_kv4_dir), *BASE, "--num-kv-blocks", "24", "-tp", "2", mode])
    try:
        out = asyncio.run(run_all(srv, jobs()))
        for job, x, y in zip(jobs(), out, reference):
            assert x == y, job
            assert len(x) == job["max_tokens"]
        m = srv.wait_idle()
        assert m["pipeline_num_preemptions_total"] > 0
        assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"] == 24
        assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"]
        # The ranks' gloo sockets are on loopback, whatever the host name resolves to.
        ranks = [p for p in srv.children if "gpu_worker" in open(f"/proc/{p}/cmdline").read()]
        assert len(ranks) == 2 and all(ip == "127.0.0.1" for p in ranks for ip, _, _ in tcp_sockets(p))
    finally:
        assert srv.stop() == 0


def test_kill_rank_1_under_load_stops_everything(tiny_kv4_dir):
    srv = Server(["--model", str(tiny_kv4_dir), *BASE, "--kv-cache-memory", "0.01", "-tp", "2"])
    rank1 = next(p for p in srv.children if b"pipeline-gpu_worker-tp1" in open(f"/proc/{p}/cmdline", "rb").read())
    clients, results = load_until_generating(srv, 4, 20, timeout=30)  # kill once generation is under way
    os.kill(rank1, signal.SIGKILL)
    code = srv.proc.wait(30)
    for t in clients:
        t.join(60)
    out = srv.output()
    assert code != 0
    assert "gpu_worker-tp1 was killed by signal SIGKILL" in out, out
    assert sum(r != 200 for r in results) >= 4, results  # at least the requests under way failed
    assert wait_gone(srv.children) == []
    assert shm_entries(srv.proc.pid) == []
    assert child_pids(srv.proc.pid) == []


def test_trace_has_a_track_per_rank(tmp_path):
    trace = tmp_path / "tp-trace.json"
    srv = Server(["--model", "sim", "--sim-step-us", "1000", "-tp", "2", "--trace", str(trace)])
    r = httpx.post(
        f"{srv.url}/v1/completions",
        timeout=60,
        json={"model": srv.model, "prompt": "hello", "max_tokens": 8, "ignore_eos": True},
    )
    assert r.status_code == 200
    assert srv.stop(signal.SIGTERM) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    pids = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    device = {pids[e["pid"]] for e in events if e["ph"] == "X" and e["name"] == "step"}
    assert device == {"gpu_worker", "gpu_worker-tp1"}
    assert set(pids.values()) == {"scheduler", "gpu_worker", "gpu_worker-tp1", "io_proc"}
