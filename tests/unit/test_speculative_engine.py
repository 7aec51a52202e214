"""The scheduler and the worker together, with speculation: any choice of drafts gives the same tokens.

The real ``Scheduler`` plans steps for a real ``ModelRunner`` (a tiny random Llama whose
outputs repeat), two steps in flight as under asynchronous scheduling, or one in lock step. The
speculation policy is replaced by random choices (how many drafts, which rows), so every path is
taken: steady rows and general rows drafting or not, rows rolled back one step late, rows whose
drafts run past a block, requests that finish, are preempted (a small KV cache) or are aborted with
drafts in flight, and a second turn of every request that finds its first turn's blocks, output
blocks included, in the prefix cache. Greedy, seeded and penalized requests must give exactly the
tokens of the same run without speculation, and every block and req_index must come back.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pipeline.common.config import EngineConfig, SpeculativeConfig
from pipeline.common.config_groups import SchedulerConfig, WorkerConfig
from pipeline.common.messages import AddRequest, SamplingParams
from pipeline.common.step_protocol import StepDescriptor, read_descriptor
from pipeline.gpu_worker.device import DeviceOps
from pipeline.gpu_worker.executor import ModelExecutor
from pipeline.gpu_worker.model_runner import ModelRunner
from pipeline.scheduler_proc import drafts as drafts_module
from pipeline.scheduler_proc.request import Request
from pipeline.scheduler_proc.scheduler import Scheduler
from tests.unit.test_speculative_runner import tiny_model

CPU = torch.device("cpu")
K = 3
BLOCK = 4


def PROMPTS(n: int) -> list[list[int]]:  # noqa: N802
    return [[(7 * i + j) % 32 for j in range(3 + i % 6)] + [5, 6, 5, 6] for i in range(n)]


def params(i: int, long: bool = False) -> SamplingParams:
    kind = i % 4
    base = dict(max_tokens=8 + 7 * (i % 5) + (150 if long and kind != 0 else 0), ignore_eos=True)
    if kind == 0:  # ends at a stop token, often inside a run of accepted drafts
        base.update(ignore_eos=False, stop_token_ids=(7, 11, 20))
    elif kind == 1:
        base.update(temperature=1.0, top_p=0.9, seed=i)
    elif kind == 2:
        base.update(presence_penalty=1.2, frequency_penalty=0.4, repetition_penalty=1.3)
    elif kind == 3:
        base.update(temperature=0.8, seed=i, logit_bias=((3, 2.0),), frequency_penalty=0.5)
    return SamplingParams(**base)


def run(
    k: int,
    pipelined: bool,
    seed: int,
    num_blocks: int = 400,
    abort: bool = False,
    long: bool = False,
    policy: bool = False,
) -> dict[int, list[int]]:
    """``long``: first turns of up to 150 tokens more, past a steady row's token buffer, drafts and all.
    ``policy``: the real policy, driven as the scheduler's loop drives it (``observe_outputs`` after each
    step), instead of random choices."""
    cfg = EngineConfig(
        model="tiny",
        served_model_name="tiny",
        max_model_len=256 if long else 96,
        num_kv_blocks=num_blocks,
        speculative=SpeculativeConfig("ngram", k, 1, 3) if k else None,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, block_size=BLOCK),
        worker=WorkerConfig(debug_token_cache_poison=True),
    )
    sched = Scheduler(8, 24, BLOCK, num_blocks, cfg.max_blocks_per_seq, num_speculative_tokens=k)
    runner = ModelRunner(cfg, ModelExecutor(cfg, tiny_model(), CPU, torch.float32), CPU, DeviceOps(CPU))
    rng = random.Random(seed)
    prepared = []
    if k and policy:
        real_prepare = sched.drafts.prepare

        def prepare():
            real_prepare()
            prepared.append(sched.drafts._prepared)

        sched.drafts.prepare = prepare
    elif k:
        # Random drafts: any k for the step, any subset of the rows that may have them.
        def choose(num_sampled, base, req_indices, remaining, budget):
            kk = rng.randint(0, k)
            ok = np.flatnonzero(remaining > kk)[: budget // max(kk, 1)]
            return (kk, np.sort(rng.sample(list(ok), rng.randint(0, len(ok))))) if kk and len(ok) else (0, ok[:0])

        sched.drafts.policy.choose = choose
    prompts = PROMPTS(14)
    for i, p in enumerate(prompts):
        sched.add_request(AddRequest(i, p, params(i, long)))
    layout = cfg.descriptor_layout
    outputs: dict[int, list[int]] = {}
    in_flight = []
    aborted = set()

    def drain() -> None:
        while sched.num_unfinished or in_flight:
            desc = StepDescriptor(layout.views(bytearray(layout.nbytes)))
            limit = 2 if pipelined else 1
            if len(in_flight) < limit and sched.num_unfinished and sched.schedule(desc):
                in_flight.append(runner.launch(read_descriptor(desc), 0))
                if policy:
                    sched.observe_outputs()
                continue
            step = runner.finish(in_flight.pop(0))
            reqs, toks = step.req_num.tolist(), step.tokens.tolist()
            sched.process_output(step.step_id, reqs, toks, 0, step.draft_matched, 1_000_000)
            for r, t in zip(reqs, toks):
                if r not in aborted:
                    outputs.setdefault(r, []).append(t)
            if abort and step.step_id == 9:
                for r in (3, 8):  # aborted with steps (and drafts) in flight
                    sched.abort_request(r)
                    aborted.add(r)

    def cut(r: int, tokens: list[int]) -> list[int]:
        """What the request got: up to max_tokens and its first stop token (later rows are dropped)."""
        p = params(r % 100, long and r < 100)
        stops = [i for i, t in enumerate(tokens) if t in p.stop_token_ids]
        return tokens[: min([p.max_tokens, *(i + 1 for i in stops[:1])])]

    drain()
    for r in outputs:
        outputs[r] = cut(r, outputs[r])
    # A second turn of every finished request: its prompt and reply, then more. The prefix cache
    # gives it the blocks its first turn named, output blocks included: one holding a rejected or
    # unverified token's keys would change its tokens.
    for i in range(len(prompts)):
        if i not in aborted:
            sched.add_request(AddRequest(100 + i, prompts[i] + outputs[i] + [9, 9], params(i)))
    drain()
    assert sched.prefix.num_hits > 0
    assert sched.pool.num_free_blocks == num_blocks and sched.pool.num_free_req_indices == 8
    if policy:  # most steps drafted as prepare chose after the step before was published
        assert sum(p is not None and p[0] > 0 for p in prepared) > len(prepared) // 2
    for r in outputs:
        outputs[r] = cut(r, outputs[r])
    return outputs


@pytest.mark.parametrize("pipelined", [True, False], ids=["async", "lock_step"])
@pytest.mark.parametrize("seed", range(3))
def test_random_drafts_give_the_same_tokens(pipelined, seed):
    assert run(K, pipelined, seed) == run(0, False, seed)


@pytest.mark.parametrize("seed", range(2))
def test_choices_prepared_between_steps_give_the_same_tokens(seed, monkeypatch):
    """As the scheduler's loop drives it, the policy chooses the drafts of the next steps after a step was
    published (``Drafts.prepare``), and each step applies that choice to its own candidates (here
    from one candidate on)."""
    monkeypatch.setattr(drafts_module, "_PREPARED_MIN_ROWS", 1)
    assert run(K, True, seed, policy=True) == run(0, False, seed)


@pytest.mark.parametrize("pipelined", [True, False], ids=["async", "lock_step"])
def test_drafts_longer_than_a_block_give_the_same_tokens(pipelined):
    """More drafts than a block holds: a row can take two new blocks in one step, steady or not."""
    assert run(BLOCK + 2, pipelined, 0) == run(0, False, 0)


def test_long_outputs_with_drafts_overflow_no_buffer():
    """Steady rows' tokens are buffered and moved to their requests every few steps; runs of
    accepted drafts fill a buffer faster than one token a step (this once raised IndexError)."""
    assert run(K, True, 0, num_blocks=2000, long=True) == run(0, False, 0, num_blocks=2000, long=True)


@pytest.mark.parametrize("seed", range(2))
def test_preemption_and_aborts_with_drafts_in_flight(seed):
    """28 blocks of 4 tokens for 8 rows of up to 40: requests are preempted and recompute."""
    plain = run(0, False, seed, num_blocks=28, abort=True)
    spec = run(K, True, seed, num_blocks=28, abort=True)
    for r in plain:
        if r in (3, 8):  # aborted: the tokens before the abort agree
            n = min(len(plain[r]), len(spec[r]))
            assert spec[r][:n] == plain[r][:n]
        else:
            assert spec[r] == plain[r], r


@pytest.mark.parametrize("steady", [False, True], ids=["general_row", "steady_row"])
def test_a_block_holding_a_rejected_draft_is_never_named(steady):
    """A request ends at a stop token that came after a rejected draft: the block whose last position
    holds that draft's keys (the stop token's own were never computed) must not go into the cache."""
    sched = Scheduler(4, 64, BLOCK, 40, 8, num_speculative_tokens=3)
    sched.drafts.policy.choose = lambda num_sampled, base, req_indices, remaining, budget: (
        3,
        np.arange(len(req_indices)),
    )
    layout = StepDescriptor.layout(4, 64, BLOCK)
    params = SamplingParams(max_tokens=20, stop_token_ids=(99,))
    sched.add_request(AddRequest(1, [1, 2, 3, 4, 5], params))

    def step(tokens: list[int]) -> None:
        step_id = sched.next_step_id
        assert sched.schedule(StepDescriptor(layout.views(bytearray(layout.nbytes))))
        sched.process_output(step_id, [1] * len(tokens), tokens, 0, np.ones(len(tokens), np.uint8), 1000)

    step([10])  # the prefill samples 10, at position 5
    if steady:
        step([11, 12, 13, 14])  # a decode with 3 drafts, all accepted: the row is steady from now on
    # Positions 5.. (or 9..) verify 3 drafts: the first is accepted, the second rejected and 99 drawn instead.
    step([20, 99])
    assert not sched.requests
    known = [1, 2, 3, 4, 5, 10] + ([11, 12, 13, 14] if steady else []) + [20, 99]
    computed = len(known) - 1  # every token's keys but the stop token's
    later = Request(2, known + [7, 7, 7, 7], SamplingParams(max_tokens=4))
    sched.prefix.name_prompt(later)
    assert len(sched.prefix.lookup(later)) == computed // BLOCK
