"""Verification of drafts is distribution-exact: speculative output follows the target's own distribution.

A tiny random Llama with a 16-token vocabulary gives the exact logits of every continuation of a
fixed prompt up to three tokens. 20,000 seeded requests each generate two tokens through the
worker's own chain (``sample_and_verify``: penalties counting the
drafts before each verified position, temperature, top-p, the race, the acceptance), with and without
speculation, and the joint distribution of the two tokens is compared with the target's, computed
independently here, by a chi-square test (p > 0.01), at temperature 1 and also with top-p and a
repetition penalty. Drafts without probabilities (prompt lookup) must also give token for token the
output without speculation; drafts drawn from a draft distribution ``q`` go through rejection
sampling (min(1, p/q), residual max(0, p - q)).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import transformers
from scipy import stats

from pipeline.common.step_protocol import MAX_LOGIT_BIAS
from pipeline.gpu_worker.device import DeviceOps, UploadBatch
from pipeline.gpu_worker.executor import SamplingInputs, sample_and_verify
from pipeline.gpu_worker.sampling.penalties import PenaltyState, plan_penalties
from pipeline.gpu_worker.sampling.rejection_sampler import VerifyInputs, accept_one_hot
from pipeline.gpu_worker.sampling.sampler import SamplingPlan, SamplingTensors

VOCAB = 16
PROMPT = [3, 7, 1]
NUM_REQUESTS = 20_000
OUTPUT_LEN = 2
K = 2  # drafts per verified row


@pytest.fixture(scope="module")
def table() -> dict[tuple[int, ...], torch.Tensor]:
    """Raw logits after the prompt followed by every continuation of up to three tokens."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,  # a spread distribution: every token has some mass
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    out = {}
    with torch.no_grad():
        for depth in range(OUTPUT_LEN + K):
            conts = list(itertools.product(range(VOCAB), repeat=depth))
            ids = torch.tensor([PROMPT + list(c) for c in conts])
            logits = model(ids).logits[:, -1].float()
            out.update(zip(conts, logits))
    return out


def reference_probs(logits: torch.Tensor, seen: list[int], top_p: float, repetition: float) -> np.ndarray:
    """The target's distribution: repetition penalty on ``seen`` tokens, softmax, top-p (independent of the worker)."""
    x = logits.double().clone()
    for t in set(seen):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    p = torch.softmax(x, 0).numpy()
    order = np.argsort(-p)
    keep = np.cumsum(p[order]) - p[order] < top_p
    out = np.zeros_like(p)
    out[order[keep]] = p[order[keep]]
    return out / out.sum()


def exact_joint(table, top_p: float, repetition: float) -> np.ndarray:
    """``[V, V]`` probability of each pair of output tokens."""
    first = reference_probs(table[()], PROMPT, top_p, repetition)
    joint = np.zeros((VOCAB, VOCAB))
    for a in range(VOCAB):
        joint[a] = first[a] * reference_probs(table[(a,)], PROMPT + [a], top_p, repetition)
    return joint


def generate(table, top_p: float, repetition: float, drafts: str) -> np.ndarray:
    """``[N, 2]`` output tokens of N seeded requests, every step through ``sample_and_verify``.

    ``drafts``: "none" (no speculation), "lookup" (drafts without probabilities: half the
    requests draft the argmax continuation, half uniform tokens), "model" (drafts drawn from a
    draft distribution q, a perturbed target, passed as probabilities) or "wrong q" (the same
    drafts, with uniform probabilities passed instead of q).
    """
    n = NUM_REQUESTS
    counts = torch.zeros(n, VOCAB, dtype=torch.int32)
    in_prompt = torch.zeros(n, VOCAB, dtype=torch.bool)
    in_prompt[:, PROMPT] = True
    state = PenaltyState(
        counts=counts,
        in_prompt=in_prompt,
        presence=torch.zeros(n),
        frequency=torch.zeros(n),
        repetition=torch.full((n,), repetition),
        bias_ids=torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.int64),
        bias_values=torch.zeros(n, MAX_LOGIT_BIAS),
    )
    rng = np.random.default_rng(1)
    q_gen = torch.Generator().manual_seed(2)
    out = [[] for _ in range(n)]
    while True:
        live = [r for r in range(n) if len(out[r]) < OUTPUT_LEN]
        if not live:
            return np.array(out)
        k = 0 if drafts == "none" else K
        draft_ids, draft_probs, rows_logits = [], [], []
        for r in live:
            prefix = tuple(out[r])
            d, q_rows = [], []
            for _ in range(k):
                ctx = prefix + tuple(d)
                if drafts in ("model", "wrong q"):
                    q = torch.softmax(table[ctx] + torch.randn(VOCAB, generator=q_gen) * 0.7, 0)
                    q_rows.append(q if drafts == "model" else torch.full((VOCAB,), 1 / VOCAB))
                    d.append(int(torch.multinomial(q, 1, generator=q_gen)))
                else:
                    d.append(int(table[ctx].argmax()) if r % 2 else int(rng.integers(VOCAB)))
            draft_ids.append(d)
            draft_probs.append(q_rows)
            rows_logits += [table[prefix + tuple(d[:j])] for j in range(k + 1)]
        width = k + 1
        s_count = len(live) * width
        req_indices = np.repeat(np.array(live), width)
        j = np.tile(np.arange(width), len(live))
        position = np.array([len(PROMPT) + len(out[r]) for r in live]).repeat(width) + j
        logits = torch.stack(rows_logits)
        # The step's input ids as the worker holds them: per row its last token, then its drafts.
        input_ids = torch.tensor([t for r, d in zip(live, draft_ids, strict=True) for t in [0, *d]], dtype=torch.int64)
        first_draft = np.repeat(np.arange(len(live)) * width + 1, width)
        pen = plan_penalties(
            req_indices,
            position - len(PROMPT),
            np.full(s_count, repetition != 1),
            np.zeros(s_count, np.int64),
            np.zeros(s_count, np.int64),
            [np.zeros(0, np.int64)] * n,
            drafts_before=j,
            first_draft=first_draft,
        )
        rows = torch.arange(s_count)
        plan = SamplingPlan.build(rows, np.zeros(s_count, np.int64), np.full(s_count, top_p), VOCAB, True)
        params = SamplingTensors(
            plan,
            temperature=torch.ones(s_count),
            top_p=torch.full((s_count,), top_p),
            top_k=torch.zeros(s_count, dtype=torch.int64),
            min_p=torch.zeros(s_count),
            seed=torch.from_numpy(req_indices.astype(np.int64)),
        )
        sampling = SamplingInputs(params, position=torch.from_numpy(position.astype(np.int64)))
        if pen is not None:
            batch = UploadBatch()
            pen.stage(batch)
            batch.upload(DeviceOps(torch.device("cpu")))
            sampling.penalties, sampling.penalty_state = pen.on_device(input_ids), state
        verify = None
        if k:
            index = torch.arange(s_count).view(len(live), width)
            verify = VerifyInputs(index=index, drafts=torch.tensor(draft_ids, dtype=torch.int64))
            if drafts in ("model", "wrong q"):
                verify.draft_probs = torch.stack([torch.stack(q) for q in draft_probs])
                verify.hot_rows, verify.hot_index = torch.arange(len(live)), index
        tokens, accepted = sample_and_verify(logits, sampling, verify)
        tokens = tokens.view(len(live), width).tolist()
        accepted = [0] * len(live) if accepted is None else accepted.tolist()
        for i, r in enumerate(live):
            emitted = tokens[i][: accepted[i] + 1][: OUTPUT_LEN - len(out[r])]
            for t in emitted:
                counts[r, t] += 1
            out[r] += emitted


def chi_square_p(samples: np.ndarray, joint: np.ndarray) -> float:
    """p-value of the observed pairs against ``joint``; cells of expected count < 5 pooled."""
    observed = np.zeros((VOCAB, VOCAB))
    np.add.at(observed, (samples[:, 0], samples[:, 1]), 1)
    expected = joint * len(samples)
    assert observed[joint == 0].sum() == 0, "a token outside the target's support was emitted"
    big = expected >= 5
    obs = np.append(observed[big], observed[~big & (joint > 0)].sum())
    exp = np.append(expected[big], expected[~big & (joint > 0)].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp).pvalue


CASES = {"temperature 1": (1.0, 1.0), "top-p 0.8": (0.8, 1.0), "repetition 1.3": (1.0, 1.3)}


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_lookup_drafts_keep_the_target_distribution(table, case):
    top_p, repetition = CASES[case]
    joint = exact_joint(table, top_p, repetition)
    plain = generate(table, top_p, repetition, "none")
    spec = generate(table, top_p, repetition, "lookup")
    assert chi_square_p(plain, joint) > 0.01
    assert chi_square_p(spec, joint) > 0.01
    # The acceptance draws the token the request would have drawn alone: same output, seed for seed.
    assert np.array_equal(spec, plain)


@pytest.mark.parametrize("case", list(CASES))
def test_draft_model_drafts_keep_the_target_distribution(table, case):
    top_p, repetition = CASES[case]
    spec = generate(table, top_p, repetition, "model")
    assert chi_square_p(spec, exact_joint(table, top_p, repetition)) > 0.01


def test_the_test_can_fail(table):
    """Verifying without the repetition penalty, or against the wrong draft distribution, is caught."""
    assert chi_square_p(generate(table, 1.0, 1.0, "lookup"), exact_joint(table, 1.0, 1.3)) < 1e-6
    assert chi_square_p(generate(table, 1.0, 1.0, "wrong q"), exact_joint(table, 1.0, 1.0)) < 1e-6


def test_accept_one_hot_takes_the_longest_equal_prefix():
    targets = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [7, 2, 3, 4], [1, 2, 3, 5]])
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 9]])
    assert accept_one_hot(targets, drafts).tolist() == [3, 1, 0, 2]
