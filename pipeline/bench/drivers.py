"""Send a workload to the engine and time every token, in-process or over HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from pipeline.bench.workloads import Workload
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


async def drive_engine(config: EngineConfig, output_rings: list[ShmRing], work: Workload, bar) -> list[RequestTimes]:
    """Play io_proc's part in-process: an EngineClient on ``output_rings`` (one per engine), every
    request submitted at once.

    The client's spans go to ``config.trace_path("io_proc")``, the file io_proc
    itself would write, so the launcher's stop() finds them with the others'.
    """
    from pipeline.io_proc.engine_client import EngineClient
    from pipeline.io_proc.tokenization import Tokenization, load_tokenizer

    tokenizer, _ = load_tokenizer(config.tokenizer)
    tokenization = Tokenization(tokenizer)
    recorder = TraceRecorder()
    client = EngineClient(config, output_rings, tokenization.make_detokenizer(), recorder)
    freeze_startup_heap()  # as io_proc does before serving
    client.start()
    try:
        return await _drive_client(client, work, bar)
    finally:
        await client.stop()
        client.close()
        tokenization.close()
        recorder.dump(config.trace_path("io_proc"))


async def _drive_client(client, work: Workload, bar) -> list[RequestTimes]:
    """Submit every request at once through a started EngineClient.

    Consumers wait for the finish only; each request's token timeline comes
    from the delivery times the client records per step, so the benchmark
    measures the runtime rather than a thousand coroutine wake-ups per step.
    The timelines are read once every request has finished: built as each
    one finishes, they cost the loop ~0.1 ms per request in the very steps
    whose io_proc CPU the benchmark reports.
    """

    async def one(i: int):
        params = SamplingParams(max_tokens=work.output_lens[i], temperature=0.0, seed=i, ignore_eos=True)
        state = client.add_request(work.prompts[i], params, stop=(), streaming=False)
        try:
            await state.wait_finished()
        finally:
            client.release(state)
        bar.update(state.num_output_tokens)
        return state

    states = await asyncio.gather(*(one(i) for i in range(len(work.prompts))))
    out = []
    for state in states:
        t = RequestTimes(submit=state.arrival_time, num_tokens=state.num_output_tokens)
        done = 0
        for when, n in state.delivery_times:
            t.token_times.extend([when] * (n - done))
            done = n
        out.append(t)
    return out


async def drive_http(url: str, model: str, work: Workload, bar) -> list[RequestTimes]:
    """Stream every request at once through the OpenAI completions API at ``url``."""
    import httpx

    async def one(client, i: int) -> RequestTimes:
        t = RequestTimes(submit=time.perf_counter())
        body = {
            "model": model,
            "prompt": work.prompts[i],
            "max_tokens": work.output_lens[i],
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                    now = time.perf_counter()
                    t.token_times.extend([now] * len(ids))
                    bar.update(len(ids))
        t.num_tokens = len(t.token_times)
        return t

    limits = httpx.Limits(max_connections=len(work.prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(len(work.prompts))))
