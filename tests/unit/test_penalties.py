"""Penalties and biases on the device equal their references, per row, with no host sync.

References: transformers' logits processors (``RepetitionPenaltyLogitsProcessor``,
``MinNewTokensLengthLogitsProcessor``, ``SequenceBiasLogitsProcessor``,
``MinPLogitsWarper``) and, for the presence and frequency penalties, which
transformers does not have, the OpenAI API reference's formula in numpy.
Then a tiny random Llama runs through ``ModelRunner`` on the CUDA code
path under the sync guard: a penalized greedy request (all of them, with
``logit_bias`` and ``min_tokens``) is prefilled in chunks while an
unpenalized one decodes, both with placeholders, and its tokens must equal
transformers' forward with the reference processors applied step by step;
its log-probabilities stay the raw model's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pipeline.common.config import EngineConfig
from pipeline.common.config_groups import SchedulerConfig, WorkerConfig
from pipeline.common.constants import cdiv
from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.messages import SamplingParams
from pipeline.common.step_protocol import MAX_LOGIT_BIAS, PLACEHOLDER_TOKEN_ID, StepDescriptor, read_descriptor
from pipeline.gpu_worker.device import DeviceOps
from pipeline.gpu_worker.executor import ModelExecutor
from pipeline.gpu_worker.model_runner import ModelRunner
from pipeline.gpu_worker.models.loader import load_model
from pipeline.gpu_worker.sampling import sampler
from pipeline.gpu_worker.sampling.penalties import PenaltyInputs, PenaltyState, apply_penalties
from pipeline.gpu_worker.sampling.sampler import apply_min_p
from tests.unit.sync_guard import FakeAsyncOps, SyncGuard

CPU = torch.device("cpu")
BLOCK = 4
VOCAB = 512


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One row's logits after the penalties and biases of ``p``, in vLLM's order, from the references."""
    ids = torch.tensor([prompt + output])
    x = logits[None].clone()
    if p.logit_bias:
        x = SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias})(ids, x)
    if p.min_tokens:
        x = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, list(p.stop_token_ids))(ids, x)
    if p.repetition_penalty != 1:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    # OpenAI API reference: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence.
    c = np.bincount(np.asarray(output, dtype=np.int64), minlength=x.shape[1]).astype(np.float32)
    x = x[0].numpy() - c * p.frequency_penalty - (c > 0) * p.presence_penalty
    return torch.from_numpy(x.astype(np.float32))


ROWS = [  # (params, prompt, output so far)
    (SamplingParams(max_tokens=9, presence_penalty=0.8, frequency_penalty=-0.5), [1, 2, 3, 3], [4, 4, 2, 9]),
    (SamplingParams(max_tokens=9, repetition_penalty=1.7, logit_bias=((7, 5.0), (3, -100.0))), [3, 5, 8], [5, 1]),
    (
        SamplingParams(
            max_tokens=9,
            min_tokens=4,
            stop_token_ids=(0, 6),
            presence_penalty=-2.0,
            frequency_penalty=2.0,
            repetition_penalty=0.6,
        ),
        [6, 0, 2],
        [2, 2, 2],
    ),
    (SamplingParams(max_tokens=9, min_tokens=2, stop_token_ids=(6,)), [6], [1, 2]),  # min_tokens reached
]


def test_each_penalty_equals_its_reference():
    vocab, n = 12, len(ROWS)
    torch.manual_seed(0)
    logits = torch.randn(n + 1, vocab) * 3  # the last row has no penalty and must stay as it is
    counts = torch.zeros(n, vocab, dtype=torch.int32)
    in_prompt = torch.zeros(n, vocab, dtype=torch.bool)
    bias_ids = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.int64)
    bias_values = torch.zeros(n, MAX_LOGIT_BIAS)
    stop_rows, stop_ids = [], []
    for i, (p, prompt, out) in enumerate(ROWS):
        counts[i] = torch.from_numpy(np.bincount(out, minlength=vocab).astype(np.int32))
        in_prompt[i, prompt] = True
        for j, (t, b) in enumerate(p.logit_bias):
            bias_ids[i, j], bias_values[i, j] = t, b
        if len(out) < p.min_tokens:
            stop_rows += [i] * len(p.stop_token_ids)
            stop_ids += list(p.stop_token_ids)
    state = PenaltyState(
        counts,
        in_prompt,
        torch.tensor([p.presence_penalty for p, *_ in ROWS]),
        torch.tensor([p.frequency_penalty for p, *_ in ROWS]),
        torch.tensor([p.repetition_penalty for p, *_ in ROWS]),
        bias_ids,
        bias_values,
    )
    inputs = PenaltyInputs(
        rows=torch.arange(n),
        req_indices=torch.arange(n),
        use_bias=True,
        use_penalties=True,
        min_tokens_rows=torch.tensor(stop_rows),
        min_tokens_ids=torch.tensor(stop_ids),
    )
    raw = logits.clone()
    got = apply_penalties(logits, inputs, state)
    assert torch.equal(logits, raw), "the raw logits (log-probabilities) must not change"
    for i, (p, prompt, out) in enumerate(ROWS):
        torch.testing.assert_close(got[i], reference(raw[i], prompt, out, p), rtol=1e-6, atol=1e-5)
    assert torch.equal(got[n], raw[n])
    assert got[2, 0] == got[2, 6] == float("-inf") and got[3, 6] > float("-inf")


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_keeps_what_transformers_keeps(min_p):
    torch.manual_seed(1)
    x = torch.randn(5, 300) * 2
    want = MinPLogitsWarper(min_p)(None, x.clone()) if min_p > 0 else x.clone()
    got = x.clone()
    apply_min_p(got, torch.full((5,), min_p))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], x[~torch.isinf(got)])


# -- through the worker --------------------------------------------------------------------------------------

PROMPT_A = [5, 17, 3, 99, 250, 7, 7, 1, 300, 42, 8]
PROMPT_B = [11, 12, 13, 14, 15]
PLAIN = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    d = tmp_path_factory.mktemp("tiny-llama-pen")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def raw_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0, -1].float()


@pytest.fixture(scope="module")
def penalized(hf_model) -> SamplingParams:
    """Every penalty at once; the stop id is what greedy would pick first, so min_tokens changes the output."""
    first = int(raw_logits(hf_model, PROMPT_A).argmax())
    return SamplingParams(
        max_tokens=16,
        temperature=0.0,
        logprobs=1,
        presence_penalty=0.4,
        frequency_penalty=0.6,
        repetition_penalty=1.5,
        min_tokens=3,
        stop_token_ids=(first,),
        logit_bias=((17, 2.0), (first + 1, -100.0)),
    )


def config() -> EngineConfig:
    return EngineConfig(
        model="tiny",
        served_model_name="tiny",
        max_model_len=64,
        num_kv_blocks=4 * cdiv(64, BLOCK),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=BLOCK),
        worker=WorkerConfig(debug_token_cache_poison=True),
    )


def script(params: SamplingParams):
    """B (unpenalized) runs; A (penalized) joins it, prefilled in chunks of 4; both decode with placeholders.
    Rows: ``(req_index, start, ids, do_sample, new_params, prompt_len)``."""
    a, ph = PROMPT_A, PLACEHOLDER_TOKEN_ID
    yield [(1, 0, PROMPT_B, True, PLAIN, len(PROMPT_B))]
    yield [(1, 5, [ph], True, None, 0), (0, 0, a[0:4], False, params, len(a))]
    yield [(0, 4, a[4:8], False, None, 0), (1, 6, [ph], True, None, 0)]
    yield [(1, 7, [ph], True, None, 0), (0, 8, a[8:11], True, None, 0)]
    for i in range(6):
        yield [(0, 11 + i, [ph], True, None, 0), (1, 8 + i, [ph], True, None, 0)]


def run(runner: ModelRunner, params: SamplingParams, launch, finish) -> dict[int, list[tuple[int, float]]]:
    """Each step launched before the previous one is finished; ``{req_index: [(token, logprob)]}``."""
    cfg, out, pending = runner.config, {0: [], 1: []}, None
    per_row = cdiv(cfg.max_model_len, BLOCK)

    def collect(step):
        step = finish(step)
        for row, req in enumerate(step.req_num):
            out[int(req)].append((int(step.tokens[row]), float(step.logprobs.logprob[row])))

    for i, rows in enumerate(script(params)):
        b = DescriptorBuilder()
        for req_index, start, ids, do_sample, new, prompt_len in rows:
            b.add_row(req_index, req_index, start, ids, do_sample, new, prompt_len=prompt_len)
            for k in range(cdiv(start, BLOCK), cdiv(start + len(ids), BLOCK)):
                b.add_block(req_index, k, req_index * per_row + k)
        desc = StepDescriptor(cfg.descriptor_layout.views(bytearray(cfg.descriptor_layout.nbytes)))
        b.write(desc, i)
        step = launch(read_descriptor(desc))
        if pending is not None:
            collect(pending)
        pending = step
    collect(pending)
    return out


def check(hf_model, params: SamplingParams, out: dict) -> None:
    a_out = [t for t, _ in out[0]]
    assert len(a_out) == 7
    for i, (token, logprob) in enumerate(out[0]):
        raw = raw_logits(hf_model, PROMPT_A + a_out[:i])
        want = reference(raw, PROMPT_A, a_out[:i], params)
        assert token == int(want.argmax()), f"output {i}"
        assert abs(logprob - torch.log_softmax(raw, -1)[token].item()) < 1e-4  # raw, before the penalties
    assert params.stop_token_ids[0] not in a_out[:3]
    b_out = [t for t, _ in out[1]]
    for i, token in enumerate(b_out):
        assert token == int(raw_logits(hf_model, PROMPT_B + b_out[:i]).argmax())


def test_penalized_request_joining_a_batch_equals_transformers_on_cpu(hf_dir, hf_model, penalized):
    cfg = config()
    runner = ModelRunner(
        cfg, ModelExecutor(cfg, load_model(str(hf_dir), torch.float32, CPU), CPU, torch.float32), CPU, DeviceOps(CPU)
    )
    check(hf_model, penalized, run(runner, penalized, lambda x: runner.launch(x, 0), runner.finish))


def test_penalties_never_sync(hf_dir, hf_model, penalized, monkeypatch):
    guard = SyncGuard()
    monkeypatch.setattr(sampler, "_COUNTER_BITS", {})
    for cls in (torch.cuda.Event, torch.cuda.Stream):
        monkeypatch.setattr(cls, "synchronize", lambda self, _n=cls.__name__: guard.flag(f"{_n}.synchronize"))
    cfg = config()
    model = load_model(str(hf_dir), torch.float32, CPU)
    guard.mark_device(*model.parameters(), *model.buffers())
    with guard, guard.paused():
        runner = ModelRunner(cfg, ModelExecutor(cfg, model, CPU, torch.float32), CPU, FakeAsyncOps(CPU, guard))

    def launch(x):
        with guard:
            return runner.launch(x, 0)

    def finish(step):
        with guard, guard.paused():
            return runner.finish(step)

    out = run(runner, penalized, launch, finish)
    assert guard.violations == [], "\n".join(guard.violations)
    check(hf_model, penalized, out)
