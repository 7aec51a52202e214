"""Async = lock step at batch 1024 on the simulated device, with joins and aborts every few steps.

The scheduler and the worker run as real processes; the test plays io_proc's
part in-process (the same EngineClient the server uses), so a thousand
streams cost no HTTP. Every simulated token depends on the whole chain
before it and poison mode is on, so one misresolved placeholder, in the
steady rows or around a batch change, changes every later token.
"""

from __future__ import annotations

import asyncio
import random

import msgspec

from pipeline.common.constants import SIM_WORD_ID_RANGE
from pipeline.common.messages import SamplingParams

BATCH = 1024
JOINS = 256  # requests that arrive while the batch runs, in waves


def jobs(seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(BATCH + JOINS):
        out.append(
            {
                "prompt": [rng.randrange(*SIM_WORD_ID_RANGE) for _ in range(rng.randrange(1, 24))],
                "max_tokens": rng.randrange(4, 80),
                "abort_after": rng.choice([None] * 9 + [rng.randrange(1, 30)]),
                "wave": 0 if i < BATCH else 1 + (i - BATCH) // 32,
            }
        )
    return out


async def run(config, output_rings, work: list[dict]) -> tuple[list[list[int]], dict]:
    """Every job's output token ids, and the scheduler's stats once every deferred free has landed."""
    from pipeline.io_proc.engine_client import EngineClient
    from pipeline.io_proc.tokenization import Tokenization, load_tokenizer

    tokenization = Tokenization(load_tokenizer(config.tokenizer)[0])
    client = EngineClient(config, output_rings, tokenization.make_detokenizer())
    client.start()

    async def one(job: dict) -> list[int]:
        await asyncio.sleep(0.02 * job["wave"])  # a wave of joins every few steps
        params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
        k = job["abort_after"]
        state = client.add_request(job["prompt"], params, stop=(), streaming=k is not None, return_token_ids=True)
        try:
            if k is None:
                await state.wait_finished()
                return state.processor.token_ids[: state.num_output_tokens]
            ids: list[int] = []
            async for _, new, _ in state.updates():
                ids.extend(new)
                if len(ids) >= k:
                    break  # released below: the request is aborted mid-generation
            return ids[:k]
        finally:
            client.release(state)

    try:
        out = await asyncio.gather(*(one(j) for j in work))
        for _ in range(100):
            stats = await client.get_stats(10.0)
            if stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks:
                break
            await asyncio.sleep(0.05)
        return out, msgspec.structs.asdict(stats)
    finally:
        await client.stop()
        client.close()
        tokenization.close()


def serve_and_run(async_scheduling: bool, work: list[dict]) -> tuple[list[list[int]], dict]:
    from pipeline.launcher import Launcher
    from pipeline.server_args import build_parser
    from pipeline.server_config import make_config

    args = build_parser().parse_args(
        [
            "--model",
            "sim",
            "--sim-step-us",
            "300",
            "--max-num-seqs",
            str(BATCH),
            "--max-num-batched-tokens",
            "2048",
            "--max-model-len",
            "128",
            "--debug-token-cache-poison",
        ]
    )
    config = make_config(args, async_scheduling=async_scheduling)
    launcher = Launcher(config, roles=("scheduler", "gpu_worker"))
    try:
        launcher.start()
        return asyncio.run(run(config, launcher.output_rings, work))
    finally:
        launcher.stop()


def test_batch_1024_async_equals_lockstep_with_joins_and_aborts():
    work = jobs(seed=1024)
    a, a_stats = serve_and_run(True, work)
    s, s_stats = serve_and_run(False, work)
    for job, x, y in zip(work, a, s):
        assert x == y, job
        assert len(x) == (
            job["max_tokens"] if job["abort_after"] is None else min(job["abort_after"], job["max_tokens"])
        )
    for st in (a_stats, s_stats):
        assert st["num_running"] == st["num_waiting"] == 0
        assert (
            st["num_free_blocks"] == st["num_total_blocks"]
            and st["num_free_req_indices"] == st["num_total_req_indices"]
        )
