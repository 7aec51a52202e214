"""The worker's whole logits-to-token chain never raises and always returns an id in the vocabulary.

Fuzzed over the full sampling-parameter space, far past what the HTTP edge accepts (extreme
penalties, biases, temperatures, top-k/top-p/min-p), over mixed batches with grammar masks and over
logits holding NaN and infinities: a bad value in one request must not stop the engine.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.common.step_protocol import MASK_BITS, MAX_LOGIT_BIAS
from pipeline.gpu_worker.executor import SamplingInputs, sample_tokens
from pipeline.gpu_worker.sampling.penalties import PenaltyInputs, PenaltyState
from pipeline.gpu_worker.sampling.sampler import SamplingPlan, SamplingTensors

VOCAB = 37
WORDS = -(-VOCAB // MASK_BITS)

extreme = st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 1e-30, 1e-6, 1.0, 2.0, 1e6, 1e30, 1e38, 3.4e38])
signed_extreme = st.one_of(extreme, extreme.map(lambda v: -v), st.floats(-1e38, 1e38))
positive = st.one_of(st.sampled_from([1e-45, 1e-38, 1e-30, 1e-5, 1.0, 1e30, 3.4e38]), st.floats(1e-38, 1e38))
logit_value = st.one_of(
    st.floats(-50, 50), st.sampled_from([float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38])
)

row = st.fixed_dictionaries(
    {
        "logits": st.lists(logit_value, min_size=VOCAB, max_size=VOCAB),
        "temperature": st.one_of(st.just(0.0), positive),
        "top_p": st.one_of(st.just(1.0), st.sampled_from([1e-9, 1e-6, 0.5, 0.9]), st.floats(1e-9, 1.0)),
        "top_k": st.one_of(st.integers(-1, VOCAB + 5), st.just(2**31 - 1)),
        "min_p": st.one_of(st.just(0.0), st.just(1.0), st.floats(0, 1)),
        "seed": st.integers(0, 2**63 - 1),
        "position": st.integers(0, 2**31 - 1),
        "presence": signed_extreme,
        "frequency": signed_extreme,
        "repetition": positive,
        "bias": st.lists(st.tuples(st.integers(0, VOCAB - 1), signed_extreme), max_size=5, unique_by=lambda b: b[0]),
        "counts": st.lists(st.integers(0, 3), min_size=VOCAB, max_size=VOCAB),
        "in_prompt": st.lists(st.booleans(), min_size=VOCAB, max_size=VOCAB),
        "min_tokens_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4, unique=True),
        "mask": st.one_of(st.none(), st.lists(st.booleans(), min_size=VOCAB, max_size=VOCAB)),
        "penalized": st.booleans(),
    }
)


def _inputs(rows: list[dict]) -> tuple[torch.Tensor, SamplingInputs]:
    n = len(rows)
    logits = torch.tensor([r["logits"] for r in rows], dtype=torch.float32)
    bias_ids = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.int64)
    bias_values = torch.zeros(n, MAX_LOGIT_BIAS)
    for i, r in enumerate(rows):
        for j, (tok, value) in enumerate(r["bias"]):
            bias_ids[i, j], bias_values[i, j] = tok, value
    state = PenaltyState(
        counts=torch.tensor([r["counts"] for r in rows], dtype=torch.int32),
        in_prompt=torch.tensor([r["in_prompt"] for r in rows]),
        presence=torch.tensor([r["presence"] for r in rows], dtype=torch.float32),
        frequency=torch.tensor([r["frequency"] for r in rows], dtype=torch.float32),
        repetition=torch.tensor([r["repetition"] for r in rows], dtype=torch.float32),
        bias_ids=bias_ids,
        bias_values=bias_values,
    )
    # Every row is its own req_index; rows with nothing to apply are left out, as plan_penalties does.
    pen = [i for i, r in enumerate(rows) if r["penalized"] or r["bias"] or r["min_tokens_ids"]]
    stop_rows = [q for q, i in enumerate(pen) for _ in rows[i]["min_tokens_ids"]]
    stop_ids = [t for i in pen for t in rows[i]["min_tokens_ids"]]
    penalties = None
    if pen:
        penalties = PenaltyInputs(
            rows=torch.tensor(pen),
            req_indices=torch.tensor(pen),
            use_bias=any(rows[i]["bias"] for i in pen),
            use_penalties=any(rows[i]["penalized"] for i in pen),
            min_tokens_rows=torch.tensor(stop_rows) if stop_rows else None,
            min_tokens_ids=torch.tensor(stop_ids) if stop_rows else None,
        )
    masked = [i for i, r in enumerate(rows) if r["mask"] is not None]
    bitmask = torch.zeros(len(masked), WORDS, dtype=torch.int64)
    for m, i in enumerate(masked):
        for tok, ok in enumerate(rows[i]["mask"]):
            bitmask[m, tok // MASK_BITS] |= int(ok) << (tok % MASK_BITS)

    temperature = np.array([r["temperature"] for r in rows], np.float32)
    sampled = np.flatnonzero(temperature > 0)
    col = {k: np.array([rows[i][k] for i in sampled]) for k in ("top_p", "top_k", "min_p", "seed", "position")}
    plan = SamplingPlan.build(
        torch.from_numpy(sampled) if len(sampled) else None,
        col["top_k"].astype(np.int64),
        col["top_p"].astype(np.float32),
        VOCAB,
        host_reads_ok=True,
        min_p=col["min_p"].astype(np.float32),
    )
    params = SamplingTensors(
        plan=plan,
        temperature=torch.from_numpy(temperature[sampled]),
        top_p=torch.tensor(col["top_p"], dtype=torch.float32),
        top_k=torch.tensor(col["top_k"], dtype=torch.int64),
        min_p=torch.tensor(col["min_p"], dtype=torch.float32),
        seed=torch.tensor(col["seed"], dtype=torch.int64),
    )
    return logits, SamplingInputs(
        params,
        position=torch.tensor(col["position"], dtype=torch.int64),
        penalties=penalties,
        penalty_state=state,
        mask_rows=torch.tensor(masked) if masked else None,
        bitmask=bitmask if masked else None,
    )


@settings(max_examples=400, deadline=None)
@given(st.lists(row, min_size=1, max_size=6))
def test_any_parameters_and_logits_give_a_token_in_the_vocabulary(rows):
    logits, sampling = _inputs(rows)
    raw = logits.clone()
    tokens = sample_tokens(logits, sampling)
    assert tokens.shape == (len(rows),) and tokens.dtype == torch.int64
    assert bool(((tokens >= 0) & (tokens < VOCAB)).all())
    assert torch.equal(logits.nan_to_num(), raw.nan_to_num())  # the raw logits stay raw (log-probabilities)


def test_a_tiny_repetition_penalty_beside_plain_rows_leaves_their_tokens_alone():
    """The request that once stopped the server: repetition_penalty 1e-38 with top-p, next to ordinary rows."""
    torch.manual_seed(0)
    plain = dict(temperature=1.0, top_p=0.9, top_k=0, min_p=0.0, presence=0.0, frequency=0.0, repetition=1.0, bias=[])
    rows = [
        dict(
            plain,
            logits=torch.randn(VOCAB).mul(4).tolist(),
            seed=7 + i,
            position=3,
            counts=[0] * VOCAB,
            in_prompt=[True] * VOCAB,
            min_tokens_ids=[],
            mask=None,
            penalized=False,
        )
        for i in range(3)
    ]
    alone = [sample_tokens(*_inputs([r])).item() for r in rows]
    rows[1] = dict(rows[1], repetition=1e-38, penalized=True)
    together = sample_tokens(*_inputs(rows)).tolist()
    assert together[0] == alone[0] and together[2] == alone[2]
    assert 0 <= together[1] < VOCAB
