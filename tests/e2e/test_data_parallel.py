"""``-dp 2``: two engines behind one io_proc serve what one engine serves, and share the load.

64 concurrent greedy requests on the tiny Llama (chunked prefill, poison
mode, some aborted mid-stream) must give the single-engine server's tokens,
both engines must have run steps, and each must end with every KV block and
req_index free. The death of one engine's scheduler stops the server, naming it.
"""

from __future__ import annotations

import asyncio
import os
import signal

from tests.conftest import SMALL, Server, child_pids, shm_entries
from tests.e2e.test_async import run_all, workload
from tests.e2e.test_lifecycle import wait_gone


def test_dp2_equals_one_engine_and_spreads_the_load(tiny_dir, tiny_async):
    srv = Server(["--model", str(tiny_dir), "--max-num-batched-tokens", "32", *SMALL, "-dp", "2"])
    try:
        jobs = workload(64, seed=64)
        out = asyncio.run(run_all(srv, jobs))
        ref = asyncio.run(run_all(tiny_async, jobs))
        for job, x, y in zip(jobs, out, ref):
            assert x == y, job
        m = srv.wait_idle()
        for e in ("0", "1"):
            label = f'{{engine="{e}"}}'
            assert m[f"pipeline_engine_num_steps_total{label}"] > 0, m  # both engines served some
            assert m[f"pipeline_engine_kv_blocks_free{label}"] == m[f"pipeline_engine_kv_blocks_total{label}"], m
            assert m[f"pipeline_engine_req_indices_free{label}"] == m[f"pipeline_engine_req_indices_total{label}"], m
        per_engine_blocks = m['pipeline_engine_kv_blocks_total{engine="0"}']
        assert m["pipeline_kv_blocks_total"] == 2 * per_engine_blocks
    finally:
        assert srv.stop() == 0


def test_a_dying_engine_stops_the_server():
    srv = Server(["--model", "sim", "--sim-step-us", "1000", "-dp", "2"])
    scheduler1 = next(p for p in srv.children if b"pipeline-scheduler-dp1" in open(f"/proc/{p}/cmdline", "rb").read())
    os.kill(scheduler1, signal.SIGKILL)
    code = srv.proc.wait(30)
    out = srv.output()
    assert code != 0
    assert "scheduler-dp1 was killed by signal SIGKILL" in out, out
    assert wait_gone(srv.children) == []
    assert shm_entries(srv.proc.pid) == []
    assert child_pids(srv.proc.pid) == []
