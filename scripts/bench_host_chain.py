"""Measure the host work on the path from a step's output to the launch of the step after next, in one thread.

The real ``Scheduler`` plans steps for the real ``ModelRunner`` on the simulated device with no step
time (its attention metadata built by the default backend, its drafts accepted with the simulated
device's probability), two steps in flight as under asynchronous scheduling, on ``pipeline-bench``'s
fixed workload (``--batch`` greedy requests, ``--output-len`` tokens each, ignoring EOS). No processes
or rings: what is left is each side's own CPU time (this thread's, so other processes on a shared
machine add noise, not time).

Prints, per step and the least of ``--runs`` runs, microseconds of: ``finish`` (the worker's output
rows of a finished step), ``apply`` (``Scheduler.process_output``), ``plan`` (``Scheduler.schedule``),
``prepare`` (``ModelRunner.launch`` up to the step's enqueue on the device), their sum ``chain``
(the path docs/perf/README.md, "Speculative decoding", follows), and off that path ``bookkeeping``
(the rest of ``launch``) and ``observe`` (the scheduler's measurements after a publish). With
``--speculation both``, with and without drafts, interleaved run by run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pipeline.common.config import EngineConfig, SpeculativeConfig
from pipeline.common.config_groups import SchedulerConfig, WorkerConfig
from pipeline.common.messages import AddRequest, SamplingParams
from pipeline.common.step_protocol import StepDescriptor, read_descriptor
from pipeline.gpu_worker.attention import make_backend
from pipeline.gpu_worker.executor import SimExecutor
from pipeline.gpu_worker.model_runner import ModelRunner
from pipeline.gpu_worker.sim_device import SimulatedDevice
from pipeline.scheduler_proc.scheduler import Scheduler

PHASES = ("finish", "apply", "plan", "prepare", "chain", "bookkeeping", "observe")


class _TimedDevice(SimulatedDevice):
    """Notes this thread's CPU time when a step is enqueued: the end of its preparation."""

    enqueued_ns = 0

    def enqueue_step(self, num_tokens: int) -> tuple[int, int]:
        self.enqueued_ns = time.thread_time_ns()
        return super().enqueue_step(num_tokens)


def run(args: argparse.Namespace, speculate: bool) -> dict[str, float]:
    """One run; returns each phase's mean CPU microseconds per step (over the last ``args.tail`` steps if set)."""
    k = args.num_speculative_tokens
    config = EngineConfig(
        model="sim",
        served_model_name="sim",
        max_model_len=args.input_len + args.output_len + k + 1,
        num_kv_blocks=args.batch * ((args.input_len + args.output_len + k) // 16 + 2),
        speculative=SpeculativeConfig("ngram", k, 2, 5) if speculate else None,
        scheduler=SchedulerConfig(
            max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens, block_size=16
        ),
        worker=WorkerConfig(sim_step_us=0),
    )
    sched = Scheduler(
        config.scheduler.max_num_seqs,
        config.scheduler.max_num_batched_tokens,
        config.scheduler.block_size,
        config.num_kv_blocks,
        config.max_blocks_per_seq,
        num_speculative_tokens=k if speculate else 0,
    )
    device = _TimedDevice(0, 0)
    runner = ModelRunner(
        config, SimExecutor(device, make_backend(config.worker.attention_backend)), torch.device("cpu")
    )
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        sched.add_request(AddRequest(i, rng.integers(10, 1000, args.input_len).tolist(), params))
    layout = config.descriptor_layout
    descs = [StepDescriptor(layout.views(bytearray(layout.nbytes))) for _ in range(3)]
    total = dict.fromkeys(PHASES, 0)
    per_step = []  # total after each launch, to take the last steps' share
    clock = time.thread_time_ns
    in_flight, steps = [], 0
    while sched.num_unfinished or in_flight:
        if len(in_flight) < 2 and sched.num_unfinished:
            desc = descs[steps % len(descs)]
            t0 = clock()
            if sched.schedule(desc):
                t1 = clock()
                in_flight.append(runner.launch(read_descriptor(desc), 0))
                t2 = clock()
                sched.observe_outputs()
                t3 = clock()
                total["plan"] += t1 - t0
                total["prepare"] += device.enqueued_ns - t1
                total["bookkeeping"] += t2 - device.enqueued_ns
                total["observe"] += t3 - t2
                per_step.append(dict(total))
                steps += 1
                continue
        t0 = clock()
        step = runner.finish(in_flight.pop(0))
        t1 = clock()
        # As scheduler_proc reads a StepOutput: int64 arrays.
        sched.process_output(
            step.step_id, step.req_num.astype(np.int64), step.tokens.numpy(), 0, step.draft_matched, 1_000_000
        )
        total["finish"] += t1 - t0
        total["apply"] += clock() - t1
    if args.tail:  # the last steps' own phases: an output's apply and finish go with the launch after it
        start = per_step[-args.tail - 1]
        total = {name: ns - start[name] for name, ns in total.items()}
    total["chain"] = total["finish"] + total["apply"] + total["plan"] + total["prepare"]
    n = args.tail or steps
    return {name: ns / n / 1000 for name, ns in total.items()} | {"steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256, help="requests, all running at once")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=1024, help="output tokens per request")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of a step")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per row at most")
    p.add_argument("--speculation", choices=("on", "off", "both"), default="both")
    p.add_argument("--runs", type=int, default=3, help="runs per setting; the least of each phase is printed")
    p.add_argument(
        "--tail", type=int, default=0, help="measure only the last TAIL steps (with drafts, where requests end)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)  # as the simulated worker runs
    settings = {"on": [True], "off": [False], "both": [True, False]}[args.speculation]
    results: dict[bool, list[dict]] = {s: [] for s in settings}
    for _ in range(args.runs):
        for s in settings:
            results[s].append(run(args, s))
    names = {True: "drafts", False: "no drafts"}
    over = f", last {args.tail} steps" if args.tail else ""
    print(f"| us per step (least of {args.runs}{over}) | " + " | ".join(names[s] for s in settings) + " |")
    print("|---|" + "---|" * len(settings))
    for phase in (*PHASES, "steps"):
        print(f"| {phase} | " + " | ".join(f"{min(r[phase] for r in results[s]):.0f}" for s in settings) + " |")


if __name__ == "__main__":
    main()
