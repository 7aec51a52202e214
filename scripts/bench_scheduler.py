"""Measure the scheduler's host work per step on its own: no processes, rings or device.

Drives ``Scheduler`` the way
scheduler_proc does with asynchronous scheduling (two steps in flight: plan
N+1, then apply N's output), on ``pipeline-bench``'s fixed workload:
``--batch`` requests of ``--input-len`` prompt tokens that each produce
``--output-len`` tokens, ignoring EOS, all arriving at once. The worker's
part is only what the scheduler sees of it: each step's output is copied
out of a real StepOutput req_index, one token per sampled row.

Prints the CPU time (this thread's, so other processes on a shared machine
only add noise, not time) of ``schedule`` and ``process_output`` per step
and their sum, as p50 / p99 / max in microseconds, over the steps after the
prefill, and the count of steps that planned steady rows (docs/design.md, "The
scheduler").
``--profile FILE`` writes a cProfile of the whole run instead.
"""

from __future__ import annotations

import argparse
import cProfile
import random
import time
from collections import deque

import numpy as np

from pipeline.common.constants import cdiv
from pipeline.common.messages import AddRequest, SamplingParams
from pipeline.common.step_output import StepOutput
from pipeline.common.step_protocol import StepDescriptor
from pipeline.scheduler_proc.scheduler import Scheduler


def run(
    batch: int, input_len: int, output_len: int, block_size: int, budget: int, depth: int, seed: int, caching: bool
) -> tuple[np.ndarray, np.ndarray, int, Scheduler]:
    """One run; returns per-step CPU ns of planning and of output processing ``[steps]``, the prefill steps
    to skip and the scheduler."""
    max_len = input_len + output_len
    num_blocks, row = batch * cdiv(max_len, block_size), cdiv(max_len, block_size)
    sched = Scheduler(batch, budget, block_size, num_blocks, row, enable_prefix_caching=caching, block_hash_root=b"r")
    dlayout = StepDescriptor.layout(batch, budget, block_size)
    descs = [StepDescriptor(dlayout.views(bytearray(dlayout.nbytes))) for _ in range(depth + 2)]
    olayout = StepOutput.layout(batch, budget)
    out = StepOutput(olayout.views(bytearray(olayout.nbytes)))
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        sched.add_request(AddRequest(i + 1, [rng.randrange(1000, 9000) for _ in range(input_len)], params))
    plan_ns, proc_ns = [], []
    inflight: deque[tuple[int, np.ndarray]] = deque()
    prefill_steps = cdiv(batch * input_len, budget) + 1
    while sched.num_unfinished or inflight:
        if len(inflight) < depth and sched.num_unfinished:
            d = descs[sched.next_step_id % len(descs)]
            t0 = time.thread_time_ns()
            n = sched.schedule(d)
            plan_ns.append(time.thread_time_ns() - t0)
            if n:
                r = d.num_reqs
                inflight.append((d.step_id, d.req_num[:r][d.do_sample[:r] == 1].copy()))
                continue
            plan_ns.pop()
        step_id, req_nums = inflight.popleft()
        out.write(step_id, req_nums, (req_nums * 7 + step_id) % 8000 + 1000)
        t0 = time.thread_time_ns()
        o = out.read()
        sched.process_output(o.step_id, o.req_nums, o.token_ids)
        proc_ns.append(time.thread_time_ns() - t0)
    return np.asarray(plan_ns), np.asarray(proc_ns), prefill_steps, sched


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=0, help="max_num_batched_tokens (default: as pipeline-bench)")
    p.add_argument("--depth", type=int, default=2, help="steps in flight: 2 async, 1 lock step")
    p.add_argument("--repeat", type=int, default=3, help="runs; per-step figures pool them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--profile", metavar="FILE", default=None, help="write a cProfile of one run here")
    a = p.parse_args()
    budget = a.budget or max(512, a.batch)
    if a.profile:
        cProfile.runctx(
            "run(a.batch, a.input_len, a.output_len, a.block_size, budget, a.depth, a.seed, a.enable_prefix_caching)",
            globals(),
            {"run": run, "a": a, "budget": budget},
            a.profile,
        )
        return
    plans, procs, steady = [], [], 0
    for i in range(a.repeat):
        plan, proc, skip, sched = run(
            a.batch, a.input_len, a.output_len, a.block_size, budget, a.depth, a.seed + i, a.enable_prefix_caching
        )
        n = min(len(plan), len(proc))
        plans.append(plan[skip:n])
        procs.append(proc[skip:n])
        steady += sched.num_steady_steps
    plan, proc = np.concatenate(plans) / 1e3, np.concatenate(procs) / 1e3
    print(
        f"batch {a.batch}, {len(plan)} decode steps over {a.repeat} runs, {steady} planned steady; "
        "CPU us p50 / p99 / max"
    )
    for name, v in (("schedule", plan), ("process_output", proc), ("sum", plan + proc)):
        print(f"  {name:15s} {np.percentile(v, 50):8.1f} {np.percentile(v, 99):8.1f} {v.max():8.1f}")


if __name__ == "__main__":
    main()
