"""Log-probabilities computed by the worker: equal to transformers, from the same step, with no host sync.

A tiny random Llama runs through ``ModelRunner`` on the CUDA code path
(under ``SyncGuard``) and on plain CPU torch. A
greedy request with ``logprobs`` and ``prompt_logprobs`` is prefilled in
chunks of 4 tokens beside a sampled request (temperature, top-k, top-p) and
then decodes with placeholders; every value must equal transformers'
``log_softmax`` over the full sequence, and the sampled row's must be the raw
model's (before its filters), finite.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from pipeline.common.config import EngineConfig
from pipeline.common.config_groups import SchedulerConfig, WorkerConfig
from pipeline.common.constants import cdiv
from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.messages import SamplingParams
from pipeline.common.step_output import MAX_LOGPROBS
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID, StepDescriptor, read_descriptor
from pipeline.gpu_worker.device import DeviceOps
from pipeline.gpu_worker.executor import ModelExecutor
from pipeline.gpu_worker.model_runner import ModelRunner
from pipeline.gpu_worker.models.loader import load_model
from pipeline.gpu_worker.sampling import sampler
from tests.unit.sync_guard import FakeAsyncOps, SyncGuard

BLOCK = 4
CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=3)
# Filters that leave most tokens at -inf: the returned value must still be the raw log-softmax.
SAMPLED = SamplingParams(max_tokens=4, temperature=1.3, top_k=3, top_p=0.5, seed=9, logprobs=2)
PROMPT_A = [5, 17, 3, 99, 250, 7, 7, 1, 300, 42, 8]
PROMPT_B = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    d = tmp_path_factory.mktemp("tiny-llama-lp")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def config() -> EngineConfig:
    return EngineConfig(
        model="tiny",
        served_model_name="tiny",
        max_model_len=64,
        num_kv_blocks=4 * cdiv(64, BLOCK),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=BLOCK),
        worker=WorkerConfig(debug_token_cache_poison=True),
    )


def descriptor(step_id: int, rows) -> object:
    """``rows``: ``(req_index, start, ids, do_sample, new_params, num_prompt_logprobs, next_prompt_token)``."""
    cfg = config()
    b = DescriptorBuilder()
    per_row = cdiv(cfg.max_model_len, BLOCK)
    for req_index, start, ids, do_sample, params, num_plp, next_tok in rows:
        b.add_row(req_index, req_index, start, ids, do_sample, params, num_plp, next_tok)
        for i in range(cdiv(start, BLOCK), cdiv(start + len(ids), BLOCK)):
            b.add_block(req_index, i, req_index * per_row + i)
    desc = StepDescriptor(cfg.descriptor_layout.views(bytearray(cfg.descriptor_layout.nbytes)))
    b.write(desc, step_id)
    return read_descriptor(desc)


def script():
    """Request 0 (greedy, log-probabilities of prompt and output) prefilled in chunks of 4 beside request 1
    (sampled, log-probabilities of its output only), then three decodes each, inputs as placeholders."""
    a, ph = PROMPT_A, PLACEHOLDER_TOKEN_ID
    yield [(0, 0, a[0:4], False, GREEDY, 4, a[4]), (1, 0, PROMPT_B, True, SAMPLED, 0, -1)]
    yield [(0, 4, a[4:8], False, None, 4, a[8]), (1, 5, [ph], True, None, 0, -1)]
    yield [(0, 8, a[8:11], True, None, 2, -1), (1, 6, [ph], True, None, 0, -1)]
    for i in range(3):
        yield [(1, 7 + i, [ph], True, None, 0, -1), (0, 11 + i, [ph], True, None, 0, -1)]


def run(runner: ModelRunner, launch, finish) -> list:
    """Each step launched before the previous one is finished; returns the finished steps."""
    out, pending = [], None
    for i, rows in enumerate(script()):
        step = launch(descriptor(i, rows))
        if pending is not None:
            out.append(finish(pending))
        pending = step
    out.append(finish(pending))
    return out


def collect(steps) -> tuple[dict, dict]:
    """Per request: ``[(token, logprob, top_ids, top_logprobs)]`` of its outputs, and its prompt entries by position."""
    outputs: dict[int, list] = {0: [], 1: []}
    prompt: dict[int, tuple] = {}
    for s in steps:
        lp = s.logprobs
        assert lp is not None and sorted(lp.index.tolist()) == list(range(len(s.req_num)))
        for row, logprob, ids, tops in zip(lp.index, lp.logprob, lp.top_ids, lp.top_logprobs):
            outputs[int(s.req_num[row])].append((int(s.tokens[row]), float(logprob), ids, tops))
        if s.prompt_logprobs is not None:
            p = s.prompt_logprobs
            assert set(p.index.tolist()) == {0}
            for pos, logprob, ids, tops in zip(p.pos, p.logprob, p.top_ids, p.top_logprobs):
                assert int(pos) not in prompt
                prompt[int(pos)] = (float(logprob), ids, tops)
    return outputs, prompt


def reference_log_softmax(hf_dir, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), V]``: row ``j`` is transformers' log-softmax predicting token ``j + 1``."""
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)


def check_against_transformers(hf_dir, steps) -> None:
    outputs, prompt = collect(steps)
    a_out = [t for t, *_ in outputs[0]]
    ref = reference_log_softmax(hf_dir, PROMPT_A + a_out)
    assert sorted(prompt) == list(range(1, len(PROMPT_A)))  # every prompt token but the first, once
    for pos, (logprob, ids, tops) in prompt.items():
        assert abs(logprob - ref[pos - 1, PROMPT_A[pos]].item()) < 1e-4
        want = ref[pos - 1].topk(MAX_LOGPROBS)
        np.testing.assert_allclose(tops, want.values.numpy(), atol=1e-4)
        assert ids[:3].tolist() == want.indices[:3].tolist()
    assert len(a_out) == 4
    for i, (token, logprob, ids, tops) in enumerate(outputs[0]):
        row = ref[len(PROMPT_A) - 1 + i]
        assert token == int(row.argmax())  # greedy
        assert abs(logprob - row[token].item()) < 1e-4 and ids[0] == token
        np.testing.assert_allclose(tops, row.topk(MAX_LOGPROBS).values.numpy(), atol=1e-4)
    b_out = [t for t, *_ in outputs[1]]
    ref_b = reference_log_softmax(hf_dir, PROMPT_B + b_out)
    for i, (token, logprob, _, tops) in enumerate(outputs[1]):
        assert np.isfinite(logprob) and np.isfinite(tops).all()
        assert abs(logprob - ref_b[len(PROMPT_B) - 1 + i, token].item()) < 1e-4


def test_logprobs_equal_transformers_on_cpu(hf_dir):
    cfg = config()
    runner = ModelRunner(
        cfg, ModelExecutor(cfg, load_model(str(hf_dir), torch.float32, CPU), CPU, torch.float32), CPU, DeviceOps(CPU)
    )
    check_against_transformers(hf_dir, run(runner, lambda x: runner.launch(x, 0), runner.finish))


def test_logprobs_never_sync_and_equal_the_cpu_path(hf_dir, monkeypatch):
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

    steps = run(runner, launch, finish)
    assert guard.violations == [], "\n".join(guard.violations)
    check_against_transformers(hf_dir, steps)
