"""The worker's speculative decoding gives token for token the output without it.

A tiny random Llama runs through ``ModelRunner`` with prompt lookup (``K`` drafts per row) and
without, driven by a small scheduler that plans as the real one does: with asynchronous scheduling
step N+1 is launched before N's tokens are read, each decoding row gets its last token as a
placeholder and ``K`` draft placeholders, positions advance as if every draft were accepted and
the rejections are learnt one step late (``num_rejected``), so the worker must move the rows back
on the device. Rows prefill, decode with and without drafts, reach ``max_tokens`` inside an
accepted run, verify a number of drafts that changes from step to step, and are mixed with a
row that never drafts. Greedy, seeded sampling and penalties
must give the same tokens as one-at-a-time decoding, and log-probabilities the same values to 1e-4;
on the CUDA code path (CPU under the sync guard) nothing waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import torch

from pipeline.common.config import SpeculativeConfig
from pipeline.common.constants import cdiv
from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.messages import SamplingParams
from pipeline.common.step_protocol import DRAFT_TOKEN_ID, PLACEHOLDER_TOKEN_ID, StepDescriptor, read_descriptor
from pipeline.gpu_worker.attention import cpu_paged
from pipeline.gpu_worker.device import DeviceOps
from pipeline.gpu_worker.executor import ModelExecutor
from pipeline.gpu_worker.model_runner import ModelRunner
from pipeline.gpu_worker.models.base import CausalLM
from pipeline.gpu_worker.sampling import sampler
from tests.unit.sync_guard import FakeAsyncOps, SyncGuard
from tests.unit.test_no_host_sync import BLOCK, engine_config
from tests.unit.test_no_host_sync import tiny_model as random_llama

K = 3
VOCAB = 32
CPU = torch.device("cpu")


def tiny_model(heads: tuple[int, int, int] = (4, 2, 16)) -> CausalLM:
    """A random Llama over a small vocabulary with peaked distributions: its outputs repeat, so drafts
    are accepted, also when sampling. ``heads`` as ``random_llama``'s."""
    model = random_llama(vocab_size=VOCAB, heads=heads)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
    return model


@dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    drafts: bool = True  # the scheduler may give this row drafts
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    computed: int = 0  # positions planned (optimistic: every draft accepted)
    in_flight: int = 0  # tokens planned in steps whose output has not been read
    rejected: int = 0  # rejections read so far
    accepted: int = 0  # drafts accepted so far
    blocks: int = 0
    new: bool = True


class MiniScheduler:
    """Plans whole prefills and decodes (with drafts where allowed) for a fixed set of requests."""

    def __init__(self, runner: ModelRunner, reqs: list[Req], k: int, vary_k: bool = True):
        self.runner, self.reqs, self.k, self.vary_k = runner, reqs, k, vary_k
        self.layout = runner.config.descriptor_layout
        self.per_req = cdiv(runner.config.max_model_len, BLOCK)
        self.step_id = 0
        self.planned: dict[int, list[tuple[int, int]]] = {}  # step -> (request, tokens planned)

    def plan(self):
        b = DescriptorBuilder()
        rows = []
        for i, r in enumerate(self.reqs):
            remaining = r.params.max_tokens - len(r.out) - r.in_flight
            if remaining <= 0:
                continue
            if r.new:
                ids, start, k = r.prompt, 0, 0
            else:
                # The step's k varies, as the policy's does (or not); one k for every row of a step.
                k = [self.k, 1, self.k - 1][self.step_id % 3] if self.vary_k else self.k
                k = k if r.drafts and self.k else 0
                k = k if remaining > k else 0
                last = r.out[-1] if r.in_flight == 0 else PLACEHOLDER_TOKEN_ID
                ids, start = [last] + [DRAFT_TOKEN_ID] * k, r.computed
            b.add_row(
                i, i, start, ids, True, r.params if r.new else None, prompt_len=len(r.prompt),
                num_drafts=k, num_rejected=r.rejected,
            )  # fmt: skip
            need = cdiv(start + len(ids), BLOCK)
            for c in range(r.blocks, need):
                b.add_block(i, c, i * self.per_req + c)
            r.blocks = max(r.blocks, need)
            r.computed, r.new = start + len(ids), False
            r.in_flight += 1 + k
            rows.append((i, 1 + k))
        if not rows:
            return None
        desc = StepDescriptor(self.layout.views(bytearray(self.layout.nbytes)))
        b.write(desc, self.step_id)
        self.planned[self.step_id] = rows
        self.step_id += 1
        return read_descriptor(desc)

    def process(self, step):
        """Apply a finished step: tokens per request, rejections learnt now."""
        tokens, req_nums = step.tokens.tolist(), step.req_num.tolist()
        lps = step.logprobs
        for i, planned in self.planned.pop(step.step_id):
            r = self.reqs[i]
            got = [t for t, n in zip(tokens, req_nums, strict=True) if n == i]
            assert 1 <= len(got) <= planned
            r.in_flight -= planned
            r.computed -= planned - len(got)
            r.rejected += planned - len(got)
            r.accepted += len(got) - 1
            keep = r.params.max_tokens - len(r.out)
            if lps is not None:
                mine = [float(lps.logprob[j]) for j in range(len(lps.index)) if req_nums[lps.index[j]] == i]
                r.logprobs += mine[:keep]
            r.out += got[:keep]


def make_runner(k: int, guard: SyncGuard | None, model: CausalLM, draft: CausalLM | None = None):
    """A runner of ``model`` with prompt lookup (``k`` drafts), or with ``draft`` as its draft model."""
    cfg = engine_config()
    if k:
        method = SpeculativeConfig("ngram", k, 1, 3) if draft is None else SpeculativeConfig("draft_model", k)
        cfg = msgspec.structs.replace(cfg, speculative=method)
    if guard is None:
        return ModelRunner(cfg, ModelExecutor(cfg, model, CPU, torch.float32), CPU, DeviceOps(CPU), draft)
    for m in (model, draft) if draft is not None else (model,):
        guard.mark_device(*m.parameters(), *m.buffers())
    with guard, guard.paused():
        return ModelRunner(cfg, ModelExecutor(cfg, model, CPU, torch.float32), CPU, FakeAsyncOps(CPU, guard), draft)


def run(
    reqs: list[Req],
    k: int,
    pipelined: bool,
    guard: SyncGuard | None = None,
    heads: tuple[int, int, int] = (4, 2, 16),
    draft: CausalLM | None = None,
    vary_k: bool = True,
) -> list[Req]:
    if guard is not None:
        sampler._COUNTER_BITS.clear()  # made outside the guard, it would not know them as device tensors
    runner = make_runner(k, guard, tiny_model(heads), draft)
    sched = MiniScheduler(runner, reqs, k, vary_k)

    def launch(x):
        if guard is None:
            return runner.launch(x, 0)
        with guard:
            return runner.launch(x, 0)

    def finish(step):
        if guard is None:
            return runner.finish(step)
        with guard, guard.paused():
            return runner.finish(step)

    pending = []
    while True:
        x = sched.plan()
        if x is not None:
            pending.append(launch(x))
        if not pending:
            return reqs
        if x is None or not pipelined or len(pending) == 2:
            sched.process(finish(pending.pop(0)))


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2)
SAMPLED = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=11, logprobs=2)
PENALIZED = SamplingParams(
    max_tokens=40,
    temperature=0.8,
    seed=3,
    repetition_penalty=1.2,
    frequency_penalty=0.3,
    presence_penalty=0.2,
    logit_bias=((3, 2.0), (7, -1.0)),
)
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2],
    list(range(8, 28)),
    [9, 9, 9, 9],
]


def requests(params: SamplingParams) -> list[Req]:
    lens = [40, 23, 31, 17]  # ends inside accepted runs of K + 1
    return [
        Req(p, msgspec.structs.replace(params, max_tokens=n, seed=params.seed + i), drafts=i != 2)
        for i, (p, n) in enumerate(zip(PROMPTS, lens, strict=True))
    ]


@pytest.fixture()
def guard(monkeypatch):
    g = SyncGuard()
    monkeypatch.setattr(sampler, "_COUNTER_BITS", {})
    return g


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, PENALIZED], ids=["greedy", "sampled", "penalized"])
@pytest.mark.parametrize("pipelined", [True, False], ids=["async", "lock_step"])
@pytest.mark.parametrize("ops", ["cpu", "cuda_path"])
def test_speculation_gives_the_tokens_of_one_at_a_time(guard, params, pipelined, ops):
    plain = run(requests(params), 0, pipelined=False)
    spec = run(requests(params), K, pipelined, guard if ops == "cuda_path" else None)
    assert guard.violations == [], "\n".join(guard.violations)
    for p, s in zip(plain, spec, strict=True):
        assert s.out == p.out and len(s.out) == s.params.max_tokens
        if params.logprobs >= 0:
            np.testing.assert_allclose(s.logprobs, p.logprobs, atol=1e-4)
    # Speculation happened: drafts were accepted and rejected.
    assert sum(r.accepted for r in spec) > 0 and sum(r.rejected for r in spec) > 0


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, PENALIZED], ids=["greedy", "sampled", "penalized"])
@pytest.mark.parametrize("pipelined", [True, False], ids=["async", "lock_step"])
def test_verify_rows_through_the_cpu_paged_kernel(params, pipelined):
    """SmolLM2's attention shape (3 query heads per KV head of size 64), which ``auto`` runs on the cpu_paged
    kernel, verify rows included: the same tokens and log-probabilities as one at a time."""
    if cpu_paged.unavailable_reason() is not None:
        pytest.skip(f"cpu_paged cannot run here: {cpu_paged.unavailable_reason()}")
    backend = tiny_model((3, 1, 64)).attn_backend
    assert backend.name == "cpu_paged" and backend.decode_query_max > K
    plain = run(requests(params), 0, pipelined=False, heads=(3, 1, 64))
    spec = run(requests(params), K, pipelined, heads=(3, 1, 64))
    for p, s in zip(plain, spec, strict=True):
        assert s.out == p.out and len(s.out) == s.params.max_tokens
        if params.logprobs >= 0:
            np.testing.assert_allclose(s.logprobs, p.logprobs, atol=1e-4)
    assert sum(r.accepted for r in spec) > 0 and sum(r.rejected for r in spec) > 0
