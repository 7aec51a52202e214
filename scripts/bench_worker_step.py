"""Host CPU time of the worker's step preparation, without the other processes.

Drives ``ModelRunner`` on the
simulated device (a zero-length step, so nothing ever sleeps) exactly as the
worker loop does per step: ``read_descriptor``, ``launch``, ``finish``. A
prefill step starts ``--batch`` requests, then decode steps follow in which
every input is a placeholder and one row in ``--block-size`` gets a new
block-table entry (the rows' positions are staggered, as in a server). Each
step's CPU time (``time.thread_time_ns``) is recorded; the script prints the
decode steps' p50, p90, p99 and max in microseconds. With ``--repeat N`` the
whole sequence runs N times, on a fresh runner each, and each step counts its
least CPU time of the N: on a shared machine other work inflates CPU time too
(caches, SMT siblings), and the minimum is what the step itself costs.

``--ops cpu`` is what ``pipeline-bench --model sim`` runs (CPU torch: uploads
are views of the host arrays); ``--ops async`` is the CUDA code path
(``AsyncOps``: staging buffers, one non-blocking copy per upload, events) on
plain host memory, so it counts the host side of that path but not the cost
of the CUDA driver calls.

``--params`` says what the requests ask for: ``greedy`` (temperature 0, no
extras), ``sampled`` (temperature, top-p, top-k, seed) or ``mixed`` (a
quarter sampled, an eighth with penalties and a logit bias, an eighth with
log-probabilities, the rest greedy).

    python scripts/bench_worker_step.py --batch 1024 --steps 300 --ops cpu async --params greedy mixed
    python scripts/bench_worker_step.py --batch 1024 --profile prof.out   # cProfile of the decode steps
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import time

import numpy as np
import torch

from pipeline.common.config import EngineConfig
from pipeline.common.config_groups import SchedulerConfig
from pipeline.common.constants import cdiv
from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.messages import SamplingParams
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID, StepDescriptor, read_descriptor
from pipeline.gpu_worker.device import AsyncOps, DeviceOps
from pipeline.gpu_worker.executor import SimExecutor
from pipeline.gpu_worker.model_runner import ModelRunner
from pipeline.gpu_worker.sim_device import SimulatedDevice

_GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0)
_SAMPLED = SamplingParams(max_tokens=1 << 20, temperature=0.8, top_p=0.9, top_k=50, seed=7)
_PENALIZED = SamplingParams(
    max_tokens=1 << 20, temperature=0.0, presence_penalty=0.5, repetition_penalty=1.1, logit_bias=((3, 2.0),)
)
_LOGPROBS = SamplingParams(max_tokens=1 << 20, temperature=0.0, logprobs=5)


class _HostAsyncOps(AsyncOps):
    """The CUDA code path's transfers on plain host memory: events that have always fired."""

    class _Event:
        def record(self, stream=None) -> None:
            pass

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, other) -> float:
            return 0.0

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def new_event(self, timing: bool = False):
        return self._Event()

    def copy_stream_ctx(self, ready):
        return contextlib.nullcontext()


def _params(kind: str, i: int) -> SamplingParams:
    if kind == "greedy":
        return _GREEDY
    if kind == "sampled":
        return _SAMPLED
    return [_SAMPLED, _SAMPLED, _PENALIZED, _LOGPROBS, _GREEDY, _GREEDY, _GREEDY, _GREEDY][i % 8]


def _descriptors(config: EngineConfig, batch: int, steps: int, prompt: int, kind: str) -> list[bytes]:
    """The prefill step, then ``steps`` decode steps, each packed as its ring entry's bytes."""
    layout = config.descriptor_layout
    per_row = cdiv(config.max_model_len, config.scheduler.block_size)
    out, blocks = [], np.zeros(batch, dtype=np.int64)
    # Staggered prompt lengths: each decode step then crosses a block boundary in about 1/block_size of the rows.
    prompt_lens = prompt + np.arange(batch) % config.scheduler.block_size
    for step in range(steps + 1):
        b = DescriptorBuilder()
        for r in range(batch):
            start = int(prompt_lens[r]) + step - 1 if step else 0
            ids = [PLACEHOLDER_TOKEN_ID] if step else list(range(1, int(prompt_lens[r]) + 1))
            need = cdiv(start + len(ids), config.scheduler.block_size)
            for i in range(int(blocks[r]), need):
                b.add_block(r, i, r * per_row + i)
            blocks[r] = max(blocks[r], need)
            b.add_row(r, r, start, ids, True, None if step else _params(kind, r), prompt_len=int(prompt_lens[r]))
        buf = bytearray(layout.nbytes)
        b.write(StepDescriptor(layout.views(buf)), step)
        out.append(bytes(buf))
    return out


def _config(batch: int) -> EngineConfig:
    return EngineConfig(
        model="sim",
        served_model_name="sim",
        max_model_len=2048,
        num_kv_blocks=batch * 128,
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(8192, batch * 48), block_size=16),
    )


def run(batch: int, descs: list[bytes], ops_kind: str, profile: str | None = None) -> np.ndarray:
    """Per-decode-step CPU microseconds of read_descriptor + launch + finish over ``descs`` (prefill first)."""
    torch.set_num_threads(1)
    config = _config(batch)
    cpu = torch.device("cpu")
    ops = DeviceOps(cpu) if ops_kind == "cpu" else _HostAsyncOps(cpu)
    runner = ModelRunner(config, SimExecutor(SimulatedDevice(0, 0)), cpu, ops)
    entry_buf = bytearray(config.descriptor_layout.nbytes)
    entry = StepDescriptor(config.descriptor_layout.views(entry_buf))
    times = []
    prof = cProfile.Profile() if profile else None
    gc.collect()
    gc.freeze()  # as the worker does after start-up
    for i, d in enumerate(descs):
        entry_buf[:] = d  # the scheduler writes the ring entry
        if prof is not None and i == 1:
            prof.enable()
        t0 = time.thread_time_ns()
        x = read_descriptor(entry)
        runner.finish(runner.launch(x, time.monotonic_ns()))
        times.append(time.thread_time_ns() - t0)
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    return np.array(times[1:]) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1024])
    p.add_argument("--steps", type=int, default=200, help="decode steps timed")
    p.add_argument("--ops", nargs="+", choices=["cpu", "async"], default=["cpu", "async"])
    p.add_argument("--params", nargs="+", choices=["greedy", "sampled", "mixed"], default=["greedy", "mixed"])
    p.add_argument("--repeat", type=int, default=1, help="runs per case; each step's least CPU time counts")
    p.add_argument("--profile", help="write a cProfile of the decode steps here (first case only)")
    args = p.parse_args()
    print("| batch | ops | params | p50 us | p90 us | p99 us | max us | mean us |")
    print("|---|---|---|---|---|---|---|---|")
    profile = args.profile
    for batch in args.batch:
        for kind in args.params:
            descs = _descriptors(_config(batch), batch, args.steps, 32, kind)
            for ops in args.ops:
                t = np.min([run(batch, descs, ops, profile if r == 0 else None) for r in range(args.repeat)], axis=0)
                profile = None
                p50, p90, p99 = np.percentile(t, [50, 90, 99])
                print(
                    f"| {batch} | {ops} | {kind} | {p50:.0f} | {p90:.0f} | {p99:.0f} | {t.max():.0f} | "
                    f"{t.mean():.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
