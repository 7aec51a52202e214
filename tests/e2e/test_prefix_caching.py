"""Prefix caching through the server: the same greedy tokens with the cache on and off, and what it reports.

The tiny Llama runs with a 32-token step budget (chunked prefill) and the
token-cache poison mode on, with the cache on (async and lock step, the
session's servers) and off (this module's). Prompts are token ids from the
completions API, so prefixes are exact. The cache must change no token:
users sharing a system prompt that ends one token before a block boundary,
on it or one after, arriving together or one after another; a conversation
resent turn by turn with the server's own replies; a prompt entirely cached;
aborts while a sharer's prompt is being prefilled; preemption under KV
pressure. What it saves is checked through the scheduler's counters and
``usage.prompt_tokens_details.cached_tokens``, never through timing.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.conftest import SMALL, Server

BS = 16  # pipeline-serve's default --block-size


@pytest.fixture(scope="module")
def tiny_nocache(tiny_dir):
    srv = Server(["--model", str(tiny_dir), "--max-num-batched-tokens", "32", "--no-enable-prefix-caching", *SMALL])
    yield srv
    assert srv.stop() == 0


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 9000) for _ in range(n)]


async def complete(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = await client.post("/v1/completions", json={**body, "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


async def abort_mid_prefill(client: httpx.AsyncClient, model: str, prompt: list[int]) -> None:
    """Stream a long prompt and leave once the response starts, before any token: the server aborts it,
    most likely while its prompt is being prefilled (32 tokens a step)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200


async def play(srv: Server, seed: int) -> list[list[int]]:
    """The workload every server plays: the output token ids of each of its requests, in a fixed order."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:

        async def one(prompt: list[int], n: int = 6) -> list[int]:
            return (await complete(client, srv.model, prompt, n))["choices"][0]["token_ids"]

        for system_len in (3 * BS - 1, 3 * BS, 3 * BS + 1):
            system = ids(rng, system_len)
            users = [system + ids(rng, rng.randrange(0, 20)) for _ in range(6)]
            out += await asyncio.gather(*(one(u) for u in users))  # together
            for u in users:  # one after another, each finding the others' blocks
                out.append(await one(u[:-1] + ids(rng, 3)))
        # A conversation: each turn resends the last with the server's reply and a new message.
        prompt = ids(rng, 70)
        for _ in range(4):
            reply = await one(prompt, 12)
            out.append(reply)
            prompt = prompt + reply + ids(rng, 9)
        # A prompt entirely cached (whole blocks only), then once more with one token more.
        whole = ids(rng, 4 * BS)
        out += [await one(whole), await one(whole), await one(whole + ids(rng, 1))]
        # Sharers of a long prompt, one aborted while the prompt is being prefilled.
        long_prompt = ids(rng, 300)
        jobs = [one(long_prompt + ids(rng, 5)) for _ in range(3)]
        results = await asyncio.gather(abort_mid_prefill(client, srv.model, long_prompt), *jobs)
        out += results[1:]
    return out


def test_greedy_outputs_equal_with_the_cache_on_and_off(tiny_async, tiny_sync, tiny_nocache):
    before = [srv.wait_idle() for srv in (tiny_async, tiny_sync)]
    on, sync, off = (asyncio.run(play(srv, seed=1)) for srv in (tiny_async, tiny_sync, tiny_nocache))
    assert on == off
    assert sync == off
    for srv, m0 in zip((tiny_async, tiny_sync), before):
        m = srv.wait_idle()
        assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"], m
        assert m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"], m
        assert m["pipeline_prefix_cache_hits_total"] - m0["pipeline_prefix_cache_hits_total"] > 1000
        assert m["pipeline_kv_blocks_cached"] > 0
    m = tiny_nocache.wait_idle()
    assert "pipeline_prefix_cache_hits_total" not in m and "pipeline_prefix_cache_queries_total" not in m
    assert m["pipeline_kv_blocks_cached"] == 0


def test_preemption_under_kv_pressure(tiny_dir):
    """A KV cache of 40 blocks for 12 users of three shared prefixes: requests are preempted (their blocks
    stay cached for their return) and the tokens are those of the same server without the cache."""
    flags = ["--model", str(tiny_dir), "--max-num-batched-tokens", "32", *SMALL, "--num-kv-blocks", "40"]
    flags += ["--max-model-len", "512"]
    rng = random.Random(5)
    prefixes = [ids(rng, n) for n in (47, 64, 90)]
    prompts = [rng.choice(prefixes) + ids(rng, rng.randrange(0, 30)) for _ in range(12)]
    outs, preempted = [], []
    for extra in ([], ["--no-enable-prefix-caching"]):
        srv = Server([*flags, *extra])
        try:

            async def go(srv=srv):
                async with httpx.AsyncClient(base_url=srv.url, timeout=900) as client:
                    rs = await asyncio.gather(*(complete(client, srv.model, p, 60) for p in prompts))
                    return [r["choices"][0]["token_ids"] for r in rs]

            outs.append(asyncio.run(go()))
            m = srv.wait_idle()
            preempted.append(m["pipeline_num_preemptions_total"])
            assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"], m
        finally:
            assert srv.stop() == 0
    assert outs[0] == outs[1]
    assert preempted[0] > 0 and preempted[1] > 0


def usage_of(srv: Server, path: str, body: dict) -> dict:
    """The usage of a chat or completion request, non-streamed or streamed (its last chunk's)."""
    if not body.get("stream"):
        r = httpx.post(f"{srv.url}{path}", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    with httpx.stream("POST", f"{srv.url}{path}", json=body, timeout=300) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return chunks[-1]["usage"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_second_identical_prompt_prefills_only_its_last_block(tiny_async, stream):
    """600 prompt tokens (37 whole blocks and 8 tokens): the second time, 592 are found cached, as the
    scheduler counts them and as usage reports them, in completions and chat alike."""
    rng = random.Random(600 + stream)
    prompt = ids(rng, 600)
    body = {"model": tiny_async.model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    first = usage_of(tiny_async, "/v1/completions", body)
    assert first["prompt_tokens"] == 600 and first["prompt_tokens_details"] == {"cached_tokens": 0}
    m0 = tiny_async.wait_idle()
    second = usage_of(tiny_async, "/v1/completions", body)
    m1 = tiny_async.wait_idle()
    assert second["prompt_tokens_details"] == {"cached_tokens": 592}
    assert m1["pipeline_prefix_cache_hits_total"] - m0["pipeline_prefix_cache_hits_total"] == 592
    assert m1["pipeline_prefix_cache_queries_total"] - m0["pipeline_prefix_cache_queries_total"] == 600
    # Chat: the same conversation twice; the second finds every whole block before its last token.
    chat = {
        "model": tiny_async.model,
        "messages": [{"role": "user", "content": " ".join(f"word{i}" for i in range(150 + stream))}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        chat["stream_options"] = {"include_usage": True}
    usage_of(tiny_async, "/v1/chat/completions", chat)
    again = usage_of(tiny_async, "/v1/chat/completions", chat)
    assert again["prompt_tokens_details"]["cached_tokens"] == (again["prompt_tokens"] - 1) // BS * BS > 0


def test_repetition_penalty_counts_the_cached_prompt(tiny_async, tiny_nocache):
    """The worker counts the repetition penalty's prompt tokens from the tokens it computes, so a penalized
    request computes its whole prompt even when it is cached: the same tokens as without the cache."""
    rng = random.Random(11)
    start = ids(rng, 40)

    async def greedy() -> list[int]:
        async with httpx.AsyncClient(base_url=tiny_nocache.url, timeout=300) as client:
            return (await complete(client, tiny_nocache.model, start, 24))["choices"][0]["token_ids"]

    reply = asyncio.run(greedy())
    prompt = start + reply + reply  # the model's own tokens, twice: greedy goes on repeating them, the penalty not
    penalty = {"repetition_penalty": 1.8, "presence_penalty": 0.5}

    async def go(srv, **extra):
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
            await complete(client, srv.model, prompt, 4)  # caches the prompt (with the cache on)
            r = await complete(client, srv.model, prompt, 24, **extra)
            return r["choices"][0]["token_ids"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

    (on, cached), (off, _) = asyncio.run(go(tiny_async, **penalty)), asyncio.run(go(tiny_nocache, **penalty))
    assert on == off and cached == 0
    plain, plain_cached = asyncio.run(go(tiny_async))
    assert plain != off, "the penalty changes the tokens"
    assert plain_cached == (len(prompt) - 1) // BS * BS


def test_logprobs_with_a_hit_equal_those_without(smol_async, smol_dir):
    """Real numerics (SmolLM2): the log-probabilities of tokens sampled after a cache hit, and the prompt
    log-probabilities of a prompt that is cached, equal those of a server without the cache to 1e-5."""
    rng = random.Random(3)
    system = ids(rng, 100)
    prompts = [system + ids(rng, 7), system + ids(rng, 12)]
    nocache = Server(["--model", str(smol_dir), "--served-model-name", "smol", "--no-enable-prefix-caching", *SMALL])
    try:

        async def go(srv):
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
                out = []
                for p in prompts:  # the second finds the system prompt's blocks
                    r = await complete(client, srv.model, p, 8, logprobs=3)
                    out.append((r["choices"][0]["token_ids"], r["choices"][0]["logprobs"], r["usage"]))
                echo = await complete(client, srv.model, prompts[1], 2, logprobs=3, echo=True)
                out.append((echo["choices"][0]["token_ids"], echo["choices"][0]["logprobs"], echo["usage"]))
                return out

        on, off = asyncio.run(go(smol_async)), asyncio.run(go(nocache))
    finally:
        assert nocache.stop() == 0
    assert on[1][2]["prompt_tokens_details"]["cached_tokens"] == 96, "the second prompt hit the system prompt"
    for (ids_on, lp_on, _), (ids_off, lp_off, _) in zip(on, off):
        assert ids_on == ids_off
        assert lp_on["tokens"] == lp_off["tokens"]
        a = [x for x in lp_on["token_logprobs"] if x is not None]
        b = [x for x in lp_off["token_logprobs"] if x is not None]
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5
        for ta, tb in zip(lp_on["top_logprobs"], lp_off["top_logprobs"]):
            if ta is not None:
                assert ta.keys() == tb.keys() and all(abs(ta[k] - tb[k]) < 1e-5 for k in ta)
