"""Asynchronous scheduling changes nothing a client sees.

Each pair of servers (the tiny Llama, and the simulated device whose every
token depends on the whole chain before it) runs with a 32-token step
budget (chunked prefill forced) and the token-cache poison mode on; the
async one must give the lock-step one's tokens exactly, including with
max_tokens=1 requests and requests aborted mid-generation, and both must
end with every KV block and req_index free. A sampled variant (temperature 1,
top-p 0.9, seeded) checks the same on the tiny Llama. Requests with
``logprobs`` and ``echo`` (prompt log-probabilities across prefill chunks,
``max_tokens`` 0 among them) must give the lock-step server's values too,
also when preemption recomputes their prompts. So must requests with
penalties, ``logit_bias``, ``min_p`` and ``min_tokens`` that join a running
unpenalized batch (their counts are updated on the device from placeholder
inputs), also when preemption re-prefills their outputs, and seeded requests
with n = 3 whose choices share a prefill.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest


def workload(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = "the of and to in is was for on that with as by at from his her an be this".split()
    out = []
    for i in range(n):
        prompt = " ".join(rng.choice(words) for _ in range(rng.choice([1, 5, 20, 60, 120])))
        out.append(
            {
                "prompt": f"{i}: {prompt}",
                "max_tokens": rng.choice([1, 1, 3, 16, 40]),
                "abort_after": rng.choice([None, None, None, 2, 5]),
            }
        )
    return out


async def run_one(client: httpx.AsyncClient, model: str, job: dict) -> list[int] | tuple:
    """The output token ids; with ``job["logprobs"]`` (echo, logprobs k, not aborted), also the
    text and the log-probabilities object."""
    body = {
        "model": model,
        "prompt": job["prompt"],
        "max_tokens": job["max_tokens"],
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **job.get("sampling", {}),
    }
    if job.get("logprobs") is not None:
        body.update(logprobs=job["logprobs"], echo=True)
    if job["abort_after"] is None:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if job.get("logprobs") is not None:
            return choice["token_ids"], choice["text"], choice["logprobs"]
        return choice["token_ids"]
    ids = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                import json

                chunk = json.loads(line[6:])
                ids.extend(chunk["choices"][0].get("token_ids") or [])
                if len(ids) >= job["abort_after"]:
                    break  # closing the stream aborts the request
    return ids[: job["abort_after"]]


async def run_all(server, jobs):
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        return await asyncio.gather(*(run_one(client, server.model, j) for j in jobs))


@pytest.mark.parametrize("concurrency", [1, 8, 64])
@pytest.mark.parametrize("model", ["tiny", "sim"])
def test_async_equals_lockstep(request, model, concurrency):
    tiny_async, tiny_sync = request.getfixturevalue(f"{model}_async"), request.getfixturevalue(f"{model}_sync")
    jobs = workload(concurrency if concurrency > 1 else 4, seed=concurrency)
    if concurrency == 1:
        a = [asyncio.run(run_all(tiny_async, [j]))[0] for j in jobs]
        s = [asyncio.run(run_all(tiny_sync, [j]))[0] for j in jobs]
    else:
        a = asyncio.run(run_all(tiny_async, jobs))
        s = asyncio.run(run_all(tiny_sync, jobs))
    for job, x, y in zip(jobs, a, s):
        assert x == y, job
        if job["abort_after"] is None:
            assert len(x) == job["max_tokens"]
    for srv in (tiny_async, tiny_sync):
        m = srv.wait_idle()
        assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"], m
        assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"], m


@pytest.mark.parametrize("concurrency", [1, 16])
def test_sampled_async_equals_lockstep(tiny_async, tiny_sync, concurrency):
    """Seeded sampling (temperature 1, top-p 0.9): a request's noise is keyed by its seed and
    position, so the async server draws exactly the lock-step server's tokens."""
    jobs = workload(concurrency if concurrency > 1 else 4, seed=100 + concurrency)
    for i, job in enumerate(jobs):
        job["sampling"] = {"temperature": 1.0, "top_p": 0.9, "seed": 1000 + i}
    if concurrency == 1:
        a = [asyncio.run(run_all(tiny_async, [j]))[0] for j in jobs]
        s = [asyncio.run(run_all(tiny_sync, [j]))[0] for j in jobs]
    else:
        a = asyncio.run(run_all(tiny_async, jobs))
        s = asyncio.run(run_all(tiny_sync, jobs))
    for job, x, y in zip(jobs, a, s):
        assert x == y, job
        if job["abort_after"] is None:
            assert len(x) == job["max_tokens"]
    # Sampling did happen: the same prompts decoded greedily give other tokens somewhere.
    greedy = asyncio.run(run_all(tiny_sync, [{**j, "sampling": {}} for j in jobs]))
    assert any(x != g for x, g in zip(s, greedy) if len(x) > 2)
    for srv in (tiny_async, tiny_sync):
        m = srv.wait_idle()
        assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"], m
        assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"], m


PENALTIES = [
    {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"repetition_penalty": 1.6, "logit_bias": {"1000": 3.0, "2000": -100}},
    {"temperature": 1.0, "seed": 7, "min_p": 0.2, "frequency_penalty": -1.0, "repetition_penalty": 0.8},
    {"min_tokens": 5, "stop_token_ids": [1000, 1001], "presence_penalty": -2.0},
]


def test_penalized_async_equals_lockstep(tiny_async, tiny_sync):
    """24 requests at once, every other one penalized: each penalized request joins a batch that is
    already decoding, and must give the lock-step server's tokens exactly."""
    jobs = workload(24, seed=55)
    for i, job in enumerate(jobs):
        if i % 2:
            job["sampling"] = PENALTIES[i // 2 % len(PENALTIES)]
            job["max_tokens"] = max(job["max_tokens"], 16)
    a = asyncio.run(run_all(tiny_async, jobs))
    s = asyncio.run(run_all(tiny_sync, jobs))
    for job, x, y in zip(jobs, a, s):
        assert x == y, job
    # The penalties did act: the same prompts decoded plainly give other tokens somewhere.
    plain = asyncio.run(run_all(tiny_sync, [{**j, "sampling": {}} for j in jobs]))
    assert any(x != p for job, x, p in zip(jobs, s, plain) if "sampling" in job)
    for srv in (tiny_async, tiny_sync):
        m = srv.wait_idle()
        assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"], m


@pytest.mark.parametrize("model", ["tiny", "sim"])
def test_logprobs_async_equal_lockstep(request, model):
    """Echo with logprobs: prompts of 1 to 120 tokens (up to four prefill chunks), max_tokens 0 to 40,
    mixed with plain and aborted requests, 24 at once."""
    srv_async, srv_sync = request.getfixturevalue(f"{model}_async"), request.getfixturevalue(f"{model}_sync")
    jobs = workload(24, seed=77)
    rng = random.Random(77)
    for job in jobs:
        if job["abort_after"] is None and rng.random() < 0.7:
            job["logprobs"] = rng.choice([0, 1, 5])
            job["max_tokens"] = rng.choice([0, 1, job["max_tokens"]])
    a = asyncio.run(run_all(srv_async, jobs))
    s = asyncio.run(run_all(srv_sync, jobs))
    assert any(job.get("logprobs") is not None and job["max_tokens"] == 0 for job in jobs)
    for job, x, y in zip(jobs, a, s):
        if model == "tiny" and job.get("logprobs") is not None:
            assert_same_logprobs(x, y)  # tokens exact; floats may differ in the last bits with the batch shape
        else:
            assert x == y, job
        if job.get("logprobs") is not None:
            ids, _, lp = x
            assert len(ids) == job["max_tokens"] and lp["token_logprobs"][0] is None
            assert len(lp["token_logprobs"]) == len(lp["tokens"]) > len(ids)
    for srv in (srv_async, srv_sync):
        m = srv.wait_idle()
        assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"], m
        assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"], m


def assert_same_logprobs(x: tuple, y: tuple, tol: float = 1e-4) -> None:
    """Equal ids, text and tokens, and log-probabilities within ``tol``.

    A real model's values depend in their last bits on the batch a row ran
    in (matrix products are blocked by batch size), which async and lock
    step form differently.
    """
    (ids_x, text_x, lp_x), (ids_y, text_y, lp_y) = x, y
    assert ids_x == ids_y and text_x == text_y and lp_x["tokens"] == lp_y["tokens"]
    assert lp_x["text_offset"] == lp_y["text_offset"]
    for a, b in zip(lp_x["token_logprobs"], lp_y["token_logprobs"]):
        assert (a is None and b is None) or abs(a - b) < tol
    for a, b in zip(lp_x["top_logprobs"], lp_y["top_logprobs"]):
        assert (a is None and b is None) or sorted(a.values()) == pytest.approx(sorted(b.values()), abs=tol)


def test_32_concurrent_openai_requests_equal_alone(tiny_async):
    client = openai.OpenAI(base_url=f"{tiny_async.url}/v1", api_key="none")
    rng = random.Random(32)
    msgs = [[{"role": "user", "content": " ".join(["hello"] * rng.randrange(1, 80)) + f" #{i}"}] for i in range(32)]
    lens = [rng.choice([1, 8, 24, 48]) for _ in msgs]

    def ask(i):
        r = client.chat.completions.create(
            model=tiny_async.model, messages=msgs[i], max_tokens=lens[i], temperature=0, extra_body={"ignore_eos": True}
        )
        return r.choices[0].message.content, r.usage.completion_tokens

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, range(32)))
    alone = [ask(i) for i in range(32)]
    assert together == alone
    assert [c for _, c in together] == lens


def test_preemption_under_kv_pressure_changes_nothing(request, tiny_dir, tiny_sync):
    """A KV cache barely larger than one request forces preemption (recompute) in flight."""
    from tests.conftest import SMALL, Server

    small = [a for a in SMALL if a not in ("--kv-cache-memory", "0.25")]
    srv = Server(["--model", str(tiny_dir), "--max-num-batched-tokens", "32", "--num-kv-blocks", "80", *small])
    request.addfinalizer(srv.stop)
    jobs = [
        {
            "prompt": f"{i}: " + "the of and " * (20 + 10 * i),
            "max_tokens": 40,
            "abort_after": None,
            "logprobs": 2 if i % 2 else None,
            "sampling": PENALTIES[i // 3 % 2] if i % 3 == 0 else {},
        }
        for i in range(12)
    ]
    a = asyncio.run(run_all(srv, jobs))
    s = asyncio.run(run_all(tiny_sync, jobs))
    for job, x, y in zip(jobs, a, s):
        if job["logprobs"] is None:
            assert x == y
        else:
            assert_same_logprobs(x, y)
    m = srv.wait_idle()
    assert m["pipeline_num_preemptions_total"] > 0
    assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"] == 80


def test_seeded_choices_async_equal_lockstep(tiny_async, tiny_sync):
    """n = 3 with seeds, six requests at once, prompts of 1 to 120 tokens (shared prefills from 0 to 7 blocks)."""
    jobs = workload(6, seed=3)

    async def run_n(server):
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:

            async def one(i, job):
                r = await client.post(
                    "/v1/completions",
                    json={
                        "model": server.model,
                        "prompt": job["prompt"],
                        "max_tokens": 12,
                        "n": 3,
                        "seed": 500 + i,
                        "temperature": 1.0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    },
                )
                assert r.status_code == 200, r.text
                return [c["token_ids"] for c in r.json()["choices"]]

            return await asyncio.gather(*(one(i, j) for i, j in enumerate(jobs)))

    assert asyncio.run(run_n(tiny_async)) == asyncio.run(run_n(tiny_sync))
    for srv in (tiny_async, tiny_sync):
        m = srv.wait_idle()
        assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"], m
        assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"], m
