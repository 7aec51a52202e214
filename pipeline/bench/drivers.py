"""Send a workload to the engine and time every token, in-process or over HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.bench.workloads import MultiTurn, Workload
from pipeline.common.config import EngineConfig
from pipeline.common.messages import SamplingParams
from pipeline.common.process import freeze_startup_heap
from pipeline.common.shm_ring import ShmRing
from pipeline.common.trace import TraceRecorder


@dataclass
class RequestTimes:
    """Client-side times of one request (``time.perf_counter`` seconds)."""

    submit: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one entry per output token
    num_tokens: int = 0
    turn: int = 0  # a multi-turn conversation's turn, from 0
    constrained: bool = False  # it had a response_format


# (prompt, max_tokens, seed) -> (whatever the driver keeps of the request, its output token ids)
Send = Callable[[list[int], int, int], Awaitable[tuple[Any, list[int]]]]


async def play(work: Workload | MultiTurn, send: Send, concurrency: int | None = None) -> list[tuple[Any, int]]:
    """Send every request of ``work`` through ``send`` (fixed: all at once or ``concurrency`` at a time; multi-turn:
    turn after turn per user); returns ``(what send kept, turn)`` per request."""
    if isinstance(work, Workload):
        gate = asyncio.Semaphore(concurrency or len(work.prompts) or 1)

        async def gated(p: list[int], n: int, i: int):
            async with gate:
                return await send(p, n, i)

        done = await asyncio.gather(*(gated(p, n, i) for i, (p, n) in enumerate(zip(work.prompts, work.output_lens))))
        return [(kept, 0) for kept, _ in done]

    async def user(u: int) -> list[tuple[Any, int]]:
        replies, out = [], []
        for turn in range(work.num_turns):
            kept, ids = await send(work.prompt(u, replies), work.output_len, u * work.num_turns + turn)
            replies.append(ids)
            out.append((kept, turn))
        return out

    return [r for rs in await asyncio.gather(*(user(u) for u in range(work.num_users))) for r in rs]


async def drive_engine(
    config: EngineConfig,
    output_rings: list[ShmRing],
    work: Workload | MultiTurn,
    bar,
    concurrency: int | None = None,
) -> tuple[list[RequestTimes], dict | None]:
    """Play io_proc's part in-process: an EngineClient on ``output_rings``; returns the times and ``spec_counts``, its
    spans in ``config.trace_path("io_proc")``."""
    from pipeline.io_proc.engine_client import EngineClient
    from pipeline.io_proc.tokenization import Tokenization, load_tokenizer

    tokenizer, _ = load_tokenizer(config.tokenizer)
    tokenization = Tokenization(tokenizer)
    recorder = TraceRecorder()
    client = EngineClient(config, output_rings, tokenization.make_detokenizer(), recorder)
    freeze_startup_heap()  # as io_proc does before serving
    client.start()
    try:
        times = await _drive_client(client, work, bar, concurrency)
        stats = await client.get_stats(30.0)
        return times, spec_counts({f: getattr(stats, f) for f in stats.__struct_fields__})
    finally:
        await client.stop()
        client.close()
        tokenization.close()
        recorder.dump(config.trace_path("io_proc"))


def spec_counts(figures: dict) -> dict | None:
    """Speculative decoding's counts from a stats reply or ``/metrics`` (vLLM's names without a prefix); None when the
    server does not speculate."""
    if figures.get("spec_decode_num_drafts") is None:
        return None
    return {k: figures[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                    "spec_decode_num_accepted_tokens")}  # fmt: skip


async def _drive_client(client, work: Workload | MultiTurn, bar, concurrency: int | None = None) -> list[RequestTimes]:
    """Play ``work`` through a started EngineClient; timelines come from the client's per-step delivery times, read once
    every request has finished."""

    async def send(prompt: list[int], max_tokens: int, seed: int):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=seed, ignore_eos=True)
        state = client.add_request(prompt, params, stop=(), streaming=False)
        try:
            await state.wait_finished()
        finally:
            client.release(state)
        bar.update(state.num_output_tokens)
        return state, list(state.processor.token_ids)

    out = []
    for state, turn in await play(work, send, concurrency):
        t = RequestTimes(submit=state.arrival_time, num_tokens=state.num_output_tokens, turn=turn)
        done = 0
        for when, n in state.delivery_times:
            t.token_times.extend([when] * (n - done))
            done = n
        out.append(t)
    return out


async def drive_http(
    url: str, model: str, work: Workload | MultiTurn, bar, concurrency: int | None = None, tokenizer=None
) -> tuple[list[RequestTimes], dict | None]:
    """Stream ``work`` through the OpenAI completions API at ``url`` (token-id prompts; ``concurrency``: as ``play``);
    returns the times and the server's speculative-decoding counts (None: it does not speculate).

    With ``tokenizer``, for servers that take text prompts and return no token ids (llama-cpp-python's): each
    prompt is sent decoded, ``min_tokens`` replaces ``ignore_eos``, and each streamed chunk counts one token (the
    replies, which a multi-turn workload resends, are then empty)."""
    import httpx

    async def send(prompt: list[int], max_tokens: int, seed: int) -> tuple[RequestTimes, list[int]]:
        t = RequestTimes(submit=time.perf_counter())
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        if tokenizer is not None:
            body["prompt"], body["min_tokens"] = tokenizer.decode(prompt), max_tokens
            del body["ignore_eos"], body["return_token_ids"]
        rf = work.response_formats[seed] if isinstance(work, Workload) and work.response_formats else None
        if rf is not None:  # it ends with its JSON (a grammar needs its stop token)
            body["response_format"], t.constrained = rf, True
            del body["ignore_eos"]
        out: list[int] = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    ids = choice.get("token_ids") or []
                    count = len(ids) if tokenizer is None else int(bool(choice.get("text")))
                    now = time.perf_counter()
                    t.token_times.extend([now] * count)
                    out += ids
                    bar.update(count)
        t.num_tokens = len(t.token_times)
        return t, out

    n = len(work.prompts) if isinstance(work, Workload) else work.num_users
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=n + 8)) as client:
        played = await play(work, send, concurrency)
        metrics = {}
        for line in (await client.get("/metrics")).text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("pipeline_spec_decode_num_") and name.endswith("_total"):
                metrics[name.removeprefix("pipeline_").removesuffix("_total")] = int(float(value))
    for t, turn in played:
        t.turn = turn
    return [t for t, _ in played], spec_counts(metrics)
