"""Drafts from a draft model (``--speculative-config`` ``draft_model``) keep the target's output.

The worker's ``ModelRunner`` with a tiny random Llama as the target and, as its draft, either a
one-layer model made of the target's embeddings, first layer and final norm (it agrees with the
target often, not always) or a copy of the target. Driven by the small scheduler of
``test_speculative_runner`` (async or lock step, drafts a number that changes per step, a row that
never drafts, ``max_tokens`` inside accepted runs): greedy rows give the tokens of one-at-a-time
decoding, penalties included, log-probabilities to 1e-4, and a draft equal to the target has every
greedy draft accepted; seeded sampled rows give the same tokens async and in lock step, and on the
CUDA code path nothing waits for the device. Then 20,000 seeded requests at temperature 1 over a
16-token vocabulary, each verifying two drafts of a different random draft model (so drafts are
rejected), give pairs of tokens distributed as the target's own (chi-square, p > 0.01), also with
top-p and a repetition penalty.
"""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
import torch
import transformers

from pipeline.common.config import SpeculativeConfig
from pipeline.common.config_groups import SchedulerConfig
from pipeline.common.constants import cdiv
from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.messages import SamplingParams
from pipeline.common.step_protocol import DRAFT_TOKEN_ID, StepDescriptor, read_descriptor
from pipeline.gpu_worker.device import DeviceOps
from pipeline.gpu_worker.executor import ModelExecutor
from pipeline.gpu_worker.model_runner import ModelRunner
from pipeline.gpu_worker.models.base import CausalLM
from tests.reference import ours_from_hf
from tests.unit.test_no_host_sync import BLOCK, engine_config
from tests.unit.test_rejection_sampler import CASES, chi_square_p, reference_probs
from tests.unit.test_speculative_runner import GREEDY, SAMPLED, VOCAB, K, requests, run, tiny_model

CPU = torch.device("cpu")
GREEDY_PENALIZED = SamplingParams(
    max_tokens=40, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
    logit_bias=((3, 2.0), (7, -1.0)), logprobs=2,
)  # fmt: skip
SAMPLED_PENALIZED = msgspec.structs.replace(GREEDY_PENALIZED, temperature=0.8, top_k=12, seed=3)


def layer0_draft() -> CausalLM:
    """``tiny_model``'s embeddings, first layer and final norm (sharpened as there)."""
    torch.manual_seed(0)  # as test_no_host_sync.tiny_model builds the target
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg)
    hf.model.layers = hf.model.layers[:1]
    hf.config.num_hidden_layers = 1
    model = ours_from_hf(hf)
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
    return model


@pytest.mark.parametrize("params", [GREEDY, GREEDY_PENALIZED], ids=["greedy", "penalized"])
@pytest.mark.parametrize("pipelined", [True, False], ids=["async", "lock_step"])
@pytest.mark.parametrize("ops", ["cpu", "cuda_path"])
def test_greedy_tokens_are_those_of_one_at_a_time(guard, params, pipelined, ops):
    plain = run(requests(params), 0, pipelined=False)
    spec = run(requests(params), K, pipelined, guard if ops == "cuda_path" else None, draft=layer0_draft())
    assert guard.violations == [], "\n".join(guard.violations)
    for p, s in zip(plain, spec, strict=True):
        assert s.out == p.out and len(s.out) == s.params.max_tokens
        np.testing.assert_allclose(s.logprobs, p.logprobs, atol=1e-4)
    assert sum(r.accepted for r in spec) > 0 and sum(r.rejected for r in spec) > 0


def test_a_draft_equal_to_the_target_has_every_greedy_draft_accepted():
    plain = run(requests(GREEDY), 0, pipelined=False)
    spec = run(requests(GREEDY), K, True, draft=tiny_model())
    assert [s.out for s in spec] == [p.out for p in plain]
    assert sum(r.rejected for r in spec) == 0 and sum(r.accepted for r in spec) > 40


@pytest.mark.parametrize("params", [SAMPLED, SAMPLED_PENALIZED], ids=["sampled", "penalized"])
def test_sampled_rows_are_reproducible_seed_for_seed(guard, params):
    """A sampled row's tokens depend on the drafts it verified (how many, when), not on the batch: the
    draft's draws, the acceptance and the residual draw are keyed by (seed, position). With the same
    drafts per request, async on the CUDA code path equals async on CPU, and each request alone
    equals the batch."""
    spec = run(requests(params), K, True, guard, draft=layer0_draft())
    assert guard.violations == [], "\n".join(guard.violations)
    assert [s.out for s in spec] == [p.out for p in run(requests(params), K, True, draft=layer0_draft())]
    assert all(len(s.out) == s.params.max_tokens for s in spec)
    assert sum(r.accepted for r in spec) > 0 and sum(r.rejected for r in spec) > 0
    draft = layer0_draft()
    batch = run(requests(params), K, False, draft=draft, vary_k=False)
    alone = [run([r], K, False, draft=draft, vary_k=False)[0] for r in requests(params)]
    assert [s.out for s in alone] == [s.out for s in batch]


@pytest.fixture()
def guard(monkeypatch):
    from pipeline.gpu_worker.sampling import sampler
    from tests.unit.sync_guard import SyncGuard

    monkeypatch.setattr(sampler, "_COUNTER_BITS", {})
    return SyncGuard()


# The distribution test: a 16-token vocabulary, a fixed prompt and input token, two drafts.
SMALL_VOCAB = 16
PROMPT = [3, 7, 1]
FIXED = 5  # the first decode step's input, given (the prefill's draw is not used)
NUM_REQUESTS = 20_000
ROWS = 1000


def spread_llama(seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def exact_pairs(hf, top_p: float, repetition: float) -> np.ndarray:
    """``[V, V]``: the target's probability of each pair of tokens after the prompt and ``FIXED``."""
    context = PROMPT + [FIXED]
    with torch.no_grad():
        first = hf(torch.tensor([context])).logits[0, -1]
        second = hf(torch.tensor([context + [a] for a in range(SMALL_VOCAB)])).logits[:, -1]
    p = reference_probs(first, context, top_p, repetition)
    return np.stack([p[a] * reference_probs(second[a], context + [a], top_p, repetition) for a in range(SMALL_VOCAB)])


def sample_pairs(target: CausalLM, draft: CausalLM, top_p: float, repetition: float) -> tuple[np.ndarray, int, int]:
    """``([N, 2] tokens, accepted, rejected)``: each request's first two tokens after ``FIXED``, the first
    decode step verifying two drafts, a second one (without drafts) when only one token came out."""
    k = 2
    cfg = msgspec.structs.replace(
        engine_config(max_model_len=32),
        scheduler=SchedulerConfig(max_num_seqs=ROWS, max_num_batched_tokens=ROWS * (k + 1), block_size=BLOCK),
        num_kv_blocks=ROWS * 2,
        speculative=SpeculativeConfig("draft_model", k),
    )
    runner = ModelRunner(cfg, ModelExecutor(cfg, target, CPU, torch.float32), CPU, DeviceOps(CPU), draft)
    layout = cfg.descriptor_layout
    step_id = itertools.count()

    def step(rows) -> tuple[list[int], list[int]]:
        b = DescriptorBuilder()
        for r, start, ids, params, drafts, rejected in rows:
            b.add_row(r, r, start, ids, True, params, prompt_len=len(PROMPT), num_drafts=drafts, num_rejected=rejected)
            for c in range(cdiv(start + len(ids), BLOCK)):
                b.add_block(r, c, 2 * r + c)
        desc = StepDescriptor(layout.views(bytearray(layout.nbytes)))
        b.write(desc, next(step_id))
        out = runner.finish(runner.launch(read_descriptor(desc), 0))
        return out.req_num.tolist(), out.tokens.tolist()

    pairs, accepted, rejected = [], 0, 0
    for base in range(0, NUM_REQUESTS, ROWS):
        params = [
            SamplingParams(max_tokens=8, temperature=1.0, top_p=top_p, repetition_penalty=repetition, seed=base + r)
            for r in range(ROWS)
        ]
        step([(r, 0, PROMPT, params[r], 0, 0) for r in range(ROWS)])
        got: dict[int, list[int]] = {r: [] for r in range(ROWS)}
        for r, t in zip(*step([(r, len(PROMPT), [FIXED] + [DRAFT_TOKEN_ID] * k, None, k, 0) for r in range(ROWS)])):
            got[r].append(t)
        short = [r for r in range(ROWS) if len(got[r]) == 1]
        accepted += sum(len(g) - 1 for g in got.values())
        rejected += len(short) + sum(len(g) == 2 for g in got.values())
        if short:
            for r, t in zip(*step([(r, len(PROMPT) + 1, got[r], None, 0, k) for r in short])):
                got[r].append(t)
        pairs += [got[r][:2] for r in range(ROWS)]
    return np.array(pairs), accepted, rejected


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_rows_keep_the_target_distribution(case):
    top_p, repetition = CASES[case]
    hf, hf_draft = spread_llama(0), spread_llama(1)
    samples, accepted, rejected = sample_pairs(ours_from_hf(hf), ours_from_hf(hf_draft), top_p, repetition)
    assert accepted > 1000 and rejected > 1000  # the draft is another model: both happen often
    assert chi_square_p(samples, exact_pairs(hf, top_p, repetition)) > 0.01


def test_the_test_can_fail(monkeypatch):
    """Verifying against another distribution than the one the drafts were drawn from is caught."""
    from pipeline.gpu_worker.spec import speculation

    verify = speculation.SpecState.verify_inputs

    def uniform_q(self, st, input_ids, positions):
        v = verify(self, st, input_ids, positions)
        if v is not None and v.draft_probs is not None:
            v.draft_probs = torch.full_like(v.draft_probs, 1 / SMALL_VOCAB)
        return v

    monkeypatch.setattr(speculation.SpecState, "verify_inputs", uniform_q)
    hf = spread_llama(0)
    samples, _, _ = sample_pairs(ours_from_hf(hf), ours_from_hf(spread_llama(1)), 1.0, 1.0)
    assert chi_square_p(samples, exact_pairs(hf, 1.0, 1.0)) < 1e-6
