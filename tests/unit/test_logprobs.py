"""Log-probability helpers of the worker: values, and which positions predict which prompt tokens."""

from __future__ import annotations

import random

import torch

from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.messages import SamplingParams
from pipeline.common.step_output import MAX_LOGPROBS
from pipeline.common.step_protocol import StepDescriptor, read_descriptor
from pipeline.gpu_worker.sampling.logprobs import PromptLogprobPlan, token_logprobs


def test_token_logprobs_are_the_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 4
    logits[2, 7] = float("-inf")  # a masked token: finite, not -inf
    tokens = torch.tensor([0, 1, 7, 299, 42])
    lp, top_ids, top_lp = token_logprobs(logits, tokens)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(lp[[0, 1, 3, 4]], ref[[0, 1, 3, 4], tokens[[0, 1, 3, 4]]])
    assert torch.isfinite(lp).all() and torch.isfinite(top_lp).all()
    assert top_ids.dtype == torch.int32 and top_ids.shape == (5, MAX_LOGPROBS)
    assert torch.equal(top_ids.long(), ref.topk(MAX_LOGPROBS).indices)
    assert (top_lp[:, :-1] >= top_lp[:, 1:]).all()


def test_prompt_plan_follows_the_prompt_across_chunks():
    """Prompts fed in random chunks beside decode rows: every position 1..p-1 is predicted once,
    by the position before it, with the prompt's own token."""
    rng = random.Random(3)
    prompts = {n: [rng.randrange(5, 1000) for _ in range(rng.randrange(1, 40))] for n in range(1, 7)}
    done = {n: 0 for n in prompts}
    seen: dict[int, dict[int, int]] = {n: {} for n in prompts}
    layout = StepDescriptor.layout(16, 64, 4)
    while any(done[n] < len(p) for n, p in prompts.items()):
        desc = StepDescriptor(layout.views(bytearray(layout.nbytes)))
        b = DescriptorBuilder()
        b.add_row(99, 15, 50, [7], True, None)  # a decode row of a request without prompt log-probabilities
        for n, p in prompts.items():
            s = done[n]
            if s >= len(p) or rng.random() < 0.3:
                continue
            k = min(rng.randrange(1, 9), len(p) - s)
            m = max(0, min(k, len(p) - 1 - s))
            b.add_row(
                n,
                n,
                s,
                p[s : s + k],
                s + k == len(p),
                SamplingParams(max_tokens=1, prompt_logprobs=2),
                m,
                p[s + k] if m == k else -1,
            )
            done[n] = s + k
        b.write(desc, 0)
        plan = PromptLogprobPlan.of(read_descriptor(desc))
        if plan is None:
            continue
        x = read_descriptor(desc)
        for f, t, r, pos in zip(plan.flat, plan.next_token, plan.req_num, plan.pos):
            assert x.token_ids[f] == prompts[r][pos - 1]  # the predicting position holds the previous token
            assert pos not in seen[r]
            seen[r][int(pos)] = int(t)
    for n, p in prompts.items():
        assert seen[n] == {i: p[i] for i in range(1, len(p))}
