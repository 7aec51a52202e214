"""The scheduler's LoRA adapter slots: at most ``max_loras`` adapters in a step, a row's slot holding its own
adapter in every step it runs (as the worker loads them, in step order), every request served in the end,
and no prefix-cache block shared across adapters."""

from __future__ import annotations

import random
from collections import deque

import pytest
from msgspec.structs import replace

from pipeline.common.messages import AddRequest, SamplingParams
from pipeline.common.step_protocol import StepDescriptor, read_descriptor
from pipeline.scheduler_proc.lora_slots import LoraSlots
from pipeline.scheduler_proc.scheduler import Scheduler
from tests.unit.test_scheduler import BS, ROOT, ReferenceExecutor, expected, make_requests


def test_slots_go_to_waiting_adapters_only_when_free():
    slots = LoraSlots(2)
    assert slots.acquire(0) == 0 and slots.can_admit(0)
    assert (slots.acquire(7), slots.acquire(8), slots.acquire(7)) == (1, 2, 1)
    assert not slots.can_admit(9)  # both slots held by running requests
    slots.release(2)
    assert slots.can_admit(9) and slots.acquire(8) == 2  # an idle slot keeps its adapter for its next request
    slots.release(2)
    slots.release(1)
    assert slots.can_admit(7)  # adapter 7 still has one running request
    assert slots.acquire(9) == 2 and not slots.can_admit(8)  # 8 was evicted from the idle slot
    assert slots.running_adapters() == [7, 9]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("max_loras", [1, 2])
def test_every_step_runs_each_row_with_its_own_adapter(depth, max_loras):
    """Requests of 4 adapters and of none, arriving at random: every step holds at most ``max_loras``
    adapters, the worker's slot (loaded from new rows, in step order) holds each row's adapter, and
    every request ends with its reference output."""
    rng = random.Random(depth * 10 + max_loras)
    requests = [replace(r, params=replace(r.params, lora_id=rng.choice([0, 1, 2, 3, 4]))) for r in make_requests(40, 3)]
    adapter = {r.req_num: r.params.lora_id for r in requests}
    max_num_seqs, budget = 6, 16
    layout = StepDescriptor.layout(max_num_seqs, budget, BS, max_blocks_per_seq=16)
    sched = Scheduler(max_num_seqs, budget, BS, 96, max_blocks_per_seq=16, block_hash_root=ROOT, max_loras=max_loras)
    ex = ReferenceExecutor(max_num_seqs, {r.req_num: list(r.prompt_token_ids) for r in requests})
    worker_slot = [0] * max_num_seqs  # per req_index, as LoraWorker keeps it
    held = [0] * (max_loras + 1)  # the adapter in each slot
    outputs = {r.req_num: [] for r in requests}
    pending, inflight, finished = deque(requests), deque(), set()
    while pending or sched.num_unfinished or inflight:
        while pending and rng.random() < 0.5:
            sched.add_request(pending.popleft())
        if len(inflight) < depth and sched.num_unfinished:
            d = StepDescriptor(layout.views(bytearray(layout.nbytes)))
            if sched.schedule(d):
                x = read_descriptor(d)
                for row, slot, lora_id in zip(x.new_rows, x.lora_slot, x.lora_id, strict=True):
                    worker_slot[x.req_index[row]] = int(slot)
                    if slot:
                        held[slot] = int(lora_id)
                in_step = {adapter[int(r)] for r in x.req_num} - {0}
                assert len(in_step) <= max_loras
                for req_num, idx in zip(x.req_num.tolist(), x.req_index.tolist(), strict=True):
                    assert (held[worker_slot[idx]] if worker_slot[idx] else 0) == adapter[req_num]
                refs = set().union(*(s[3] for s in inflight)) if inflight else set()
                inflight.append(ex.execute(x, refs))
                continue
        if inflight:
            sid, reqs, toks, _ = inflight.popleft()
            for r, t in zip(reqs, toks, strict=True):
                if r not in finished and r in sched.requests:
                    outputs[r].append(t)
            finished.update(sched.process_output(sid, reqs, toks))
        elif pending:
            sched.add_request(pending.popleft())
    for r in requests:
        assert outputs[r.req_num] == expected(r), r.req_num


def test_identical_prompts_on_two_adapters_share_no_block():
    """The same prompt on adapter 1, again on 1 (its blocks reused), on 2 and on the base (none reused)."""
    layout = StepDescriptor.layout(4, 64, BS, max_blocks_per_seq=16)
    sched = Scheduler(4, 64, BS, 64, max_blocks_per_seq=16, block_hash_root=ROOT, max_loras=2)
    prompt = list(range(100, 121))
    hits = []
    for num, lora_id in enumerate([1, 1, 2, 0, 2], start=1):
        req = AddRequest(num, prompt, SamplingParams(max_tokens=1, temperature=0.0, lora_id=lora_id))
        sched.add_request(req)
        d = StepDescriptor(layout.views(bytearray(layout.nbytes)))
        assert sched.schedule(d)
        x = read_descriptor(d)
        hits.append(int(x.start_pos[0]))
        sched.process_output(x.step_id, [num], [5])
    assert hits == [0, 20, 0, 0, 20]
