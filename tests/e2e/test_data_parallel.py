"""``-dp 2``: two engines behind one io_proc serve what one engine serves, and share the load.

64 concurrent greedy requests on the tiny Llama (chunked prefill, poison
mode, some aborted mid-stream) must give the single-engine server's tokens,
both engines must have run steps, and each must end with every KV block and
req_index free. The death of one engine's scheduler stops the server, naming it.
A conversation's next turn goes to the engine that holds its history.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

import httpx

from tests.conftest import SMALL, Server, child_pids, shm_entries
from tests.e2e.test_async import run_all, workload
from tests.e2e.test_lifecycle import wait_gone


def vllm_value(text: str, name: str, engine: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + "{") and f'engine="{engine}"' in x)
    return float(line.rsplit(" ", 1)[1])


def test_dp2_equals_one_engine_and_spreads_the_load(tiny_dir, tiny_async):
    srv = Server(
        ["--model", str(tiny_dir), "--max-num-batched-tokens", "32", *SMALL, "-dp", "2", "--metrics-compat", "vllm"]
    )
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
        # vLLM's names label each engine; the pipeline_ totals are their sums.
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        for name in ("vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count"):
            per_engine = [vllm_value(text, name, e) for e in ("0", "1")]
            assert min(per_engine) > 0 and sum(per_engine) == m[name.replace("vllm:", "pipeline_")], (name, per_engine)
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


def test_dp2_sends_a_conversation_back_to_the_engine_that_served_it(tiny_dir):
    """Turn 1 of conversation A goes to engine 0 (all idle); B's turn 1, sent while A runs, to engine 1
    (the least loaded). B's turn 2, sent when both are idle, would go to engine 0 by load alone: it goes
    to engine 1, which holds B's history, and finds it there (its per-engine hits)."""
    import httpx

    rng = random.Random(2)
    srv = Server(["--model", str(tiny_dir), "--max-num-batched-tokens", "32", *SMALL, "-dp", "2"])
    try:
        a1, b1 = [rng.randrange(1000, 9000) for _ in range(80)], [rng.randrange(1000, 9000) for _ in range(80)]
        body = {"model": srv.model, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

        async def turns():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
                async with client.stream(
                    "POST", "/v1/completions", json={**body, "prompt": a1, "max_tokens": 200, "stream": True}
                ) as ra:
                    lines = ra.aiter_lines()
                    async for line in lines:
                        if line.startswith("data: {"):
                            break  # A runs on engine 0
                    rb = await client.post("/v1/completions", json={**body, "prompt": b1, "max_tokens": 8})
                    async for _ in lines:
                        pass
                return rb.json()["choices"][0]["token_ids"]

        b1_reply = asyncio.run(turns())
        m0 = srv.wait_idle()
        assert m0['pipeline_engine_prefix_cache_queries_total{engine="1"}'] == 80, "B's turn 1 ran on engine 1"
        b2 = b1 + b1_reply + [rng.randrange(1000, 9000) for _ in range(10)]
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "prompt": b2, "max_tokens": 4}, timeout=300)
        assert r.status_code == 200
        m1 = srv.wait_idle()
        hits = {e: m1[f'pipeline_engine_prefix_cache_hits_total{{engine="{e}"}}'] for e in "01"}
        before = {e: m0[f'pipeline_engine_prefix_cache_hits_total{{engine="{e}"}}'] for e in "01"}
        assert hits["0"] == before["0"], "turn 2 went to engine 0"
        assert hits["1"] - before["1"] == (80 + 8 - 1) // 16 * 16  # B's prompt and reply, whole blocks
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == hits["1"] - before["1"]
    finally:
        assert srv.stop() == 0
