"""Soak on the simulated device (issue 10): many requests with random aborts and disconnects.

After the soak nothing runs, every block and req_index is free, io_proc's RSS is
within 5 % of its value after warm-up, and no process holds more file
descriptors than then. ``PIPELINE_SOAK_REQUESTS`` (default 1,500) and
``PIPELINE_SOAK_CONCURRENCY`` (default 128) size it; the issue's full soak is
20,000 at 256.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import pytest

from tests.conftest import Server
from tests.e2e.test_faults import cmdline

WARMUP = 300


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def one(client: httpx.AsyncClient, model: str, rng: random.Random) -> None:
    body = {
        "model": model,
        "prompt": "hello " * rng.randint(1, 40),
        "max_tokens": rng.randint(1, 48),
        "ignore_eos": True,
    }
    kind = rng.random()
    try:
        if kind < 0.4:  # a stream, often dropped by its client part-way
            keep = rng.choice([1, 2, 5, None])
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if keep is not None and n >= keep:
                        break  # closing the response drops the connection mid-stream
        elif kind < 0.6:  # a client that gives up waiting
            await client.post("/v1/completions", json=body, timeout=rng.uniform(0.001, 0.05))
        else:
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
    except httpx.TimeoutException:
        pass


async def soak(url: str, model: str, n: int, concurrency: int, seed: int) -> None:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def guarded():
            async with sem:
                await one(client, model, rng)

        await asyncio.gather(*(guarded() for _ in range(n)))


@pytest.mark.slow
def test_soak_leaves_no_trace():
    n = int(os.environ.get("PIPELINE_SOAK_REQUESTS", "1500"))
    concurrency = int(os.environ.get("PIPELINE_SOAK_CONCURRENCY", "128"))
    srv = Server(["--model", "sim", "--sim-step-us", "1000", "--max-num-seqs", "256", "--max-model-len", "512"])
    try:
        io = next(p for p in srv.children if "pipeline-io_proc" in cmdline(p))
        asyncio.run(soak(srv.url, srv.model, WARMUP, concurrency, seed=0))
        m = srv.wait_idle()
        rss0, fds0 = rss_kb(io), {p: fds(p) for p in srv.children}
        t0 = time.monotonic()
        asyncio.run(soak(srv.url, srv.model, n, concurrency, seed=1))
        took = time.monotonic() - t0
        m = srv.wait_idle()
        assert m["pipeline_num_requests_running"] == 0 and m["pipeline_num_requests_waiting"] == 0, m
        assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"], m
        assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"], m
        deadline = time.monotonic() + 10  # connections the clients dropped are closed within a poll or two
        while any(fds(p) > fds0[p] for p in srv.children) and time.monotonic() < deadline:
            time.sleep(0.2)
        rss1 = rss_kb(io)
        print(
            f"\nsoak: {n} requests at concurrency {concurrency} in {took:.1f} s; io_proc RSS "
            f"{rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MiB; fds {fds0} -> { {p: fds(p) for p in srv.children} }"
        )
        assert all(fds(p) <= fds0[p] for p in srv.children)
        assert abs(rss1 - rss0) <= 0.05 * rss0
    finally:
        srv.stop()
