"""Measure io_proc's host cost per step alone: the output reader and the event loop, no engine.

A feeder thread plays the worker: it writes one StepOutput per ``--step-us``
into a real output ring (and consumes the scheduler's reader side), every
row a live request of an ``EngineClient``
over the SmolLM2 tokenizer, exactly as ``pipeline-bench --model sim`` drives
io_proc: ``--batch`` non-streaming requests (``--streaming`` for streams
that read ``RequestState.updates``), all admitted in the first step,
then one token each per step until all finish at ``--output-len``. Tokens
are random ids from the simulated device's range, or with ``--text`` the
tokens of a mixed text (accents, CJK, emoji split over tokens) in a loop.

Reported, over the steady steps (the first and last are left out):

- ``cpu/step``: CPU time of the whole process (every thread) between two
  steps, the figure ``pipeline-bench`` prints as "io_proc CPU/step";
- ``process_step``: wall time of the reader thread's handling of one step
  (its ``detokenize`` span);
- ``detokenize/token``: one request's detokenizer alone, per token, over the
  same token stream.

    .venv/bin/python scripts/bench_output_reader.py
    .venv/bin/python scripts/bench_output_reader.py --batch 1024 --text --streaming
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import tempfile
import threading
import time

import numpy as np

from pipeline.common.config import EngineConfig
from pipeline.common.config_groups import SchedulerConfig
from pipeline.common.constants import SIM_WORD_ID_RANGE
from pipeline.common.messages import SamplingParams
from pipeline.common.model_files import convert_gguf, default_model_path
from pipeline.common.process import freeze_startup_heap
from pipeline.common.shm_ring import ShmRing
from pipeline.common.step_output import OUTPUT_READER_SCHEDULER, StepOutput
from pipeline.common.trace import TraceRecorder
from pipeline.io_proc.engine_client import EngineClient
from pipeline.io_proc.tokenization import Tokenization, load_tokenizer

TEXT = (
    "Café, naïve, façade, déjà vu. 日本語のテキストと中文文本。Emoji 😀 then 🎉🎉 and 👨‍👩‍👧‍👦. "
    "Plain words make up most of any output, so here are some more of them. "
)


def token_stream(tokenizer, text: bool, n: int, seed: int) -> list[int]:
    """``n`` token ids: random ones in the simulated device's range, or ``TEXT``'s tokens from a random offset."""
    rng = random.Random(seed)
    if not text:
        return [rng.randrange(*SIM_WORD_ID_RANGE) for _ in range(n)]
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    start = rng.randrange(len(ids))
    return list(itertools.islice(itertools.cycle(ids[start:] + ids[:start]), n))


def feed(ring: ShmRing[StepOutput], streams: np.ndarray, req_nums: np.ndarray, step_s: float) -> None:
    """Write step ``k``'s row ``i`` = ``(req_nums[i], streams[i, k])`` every ``step_s`` seconds."""
    t = time.monotonic()
    for k in range(streams.shape[1]):
        entry = ring.acquire_write()
        entry.write(k, req_nums, streams[:, k])
        ring.publish()
        ring.acquire_read(OUTPUT_READER_SCHEDULER)
        ring.release_read(OUTPUT_READER_SCHEDULER)
        t += step_s
        time.sleep(max(0.0, t - time.monotonic()))


async def run(args, client: EngineClient, ring: ShmRing[StepOutput], streams: np.ndarray) -> None:
    client.start()
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    states = [client.add_request([1, 2, 3], params, stop=(), streaming=args.streaming) for _ in range(args.batch)]

    async def consume(state) -> None:
        if args.streaming:
            async for _ in state.updates():
                pass
        else:
            await state.wait_finished()
        client.release(state)

    req_nums = np.array([s.req_num for s in states], dtype=np.int64)
    feeder = threading.Thread(target=feed, args=(ring, streams, req_nums, args.step_us / 1e6), daemon=True)
    feeder.start()
    await asyncio.gather(*(consume(s) for s in states))
    await asyncio.to_thread(feeder.join)
    await client.stop()
    if any(s.finish_reason != "length" or s.num_output_tokens != args.output_len for s in states):
        raise RuntimeError("not every request finished with all its tokens")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--step-us", type=int, default=2000, help="time between two steps (the device's step time)")
    p.add_argument("--text", action="store_true", help="tokens of a mixed text instead of random word ids")
    p.add_argument("--streaming", action="store_true", help="streaming consumers (woken per step)")
    args = p.parse_args()

    tokenizer, _ = load_tokenizer(str(convert_gguf(default_model_path())))
    tokenization = Tokenization(tokenizer)
    streams = np.array(
        [token_stream(tokenizer, args.text, args.output_len, i) for i in range(args.batch)], dtype=np.int32
    )

    new_detok = tokenization.make_detokenizer()
    flat = streams[:64].ravel().tolist()
    t0 = time.process_time_ns()
    for row in streams[:64].tolist():
        d = new_detok()
        for tok in row:
            d.push(tok)
    detok_ns = (time.process_time_ns() - t0) / len(flat)

    with tempfile.TemporaryDirectory() as ipc_dir:
        config = EngineConfig(
            model="sim",
            served_model_name="sim",
            tokenizer="",
            ipc_dir=ipc_dir,
            scheduler=SchedulerConfig(max_num_seqs=args.batch),
        )
        ring = ShmRing(
            f"/bench-output-reader-{os.getpid()}",
            StepOutput.layout(args.batch, args.batch),
            4,
            2,
            create=True,
            wrap=StepOutput,
        )
        ring.unlink()
        trace = TraceRecorder()
        client = EngineClient(config, [ring], new_detok, trace)
        freeze_startup_heap()  # as io_proc does before serving
        try:
            asyncio.run(run(args, client, ring, streams))
        finally:
            client.close()
            tokenization.close()

    cpu = [s[6] / 1e3 for s in trace.spans if s[1] == "cpu"][1:-1]
    step = [(s[5] - s[4]) / 1e3 for s in trace.spans if s[2] == "detokenize"][1:-1]
    q = lambda v, pct: float(np.percentile(v, pct))  # noqa: E731
    print(
        f"batch {args.batch}, {len(cpu)} steady steps, {'streaming' if args.streaming else 'non-streaming'}, "
        f"{'text' if args.text else 'random word'} tokens"
    )
    print(f"cpu/step          p50 {q(cpu, 50):8.1f} us  p99 {q(cpu, 99):8.1f} us  mean {statistics.mean(cpu):8.1f} us")
    print(f"process_step      p50 {q(step, 50):8.1f} us  p99 {q(step, 99):8.1f} us")
    print(f"detokenize/token      {detok_ns / 1e3:8.3f} us")


if __name__ == "__main__":
    main()
