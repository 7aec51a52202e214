"""Sampler: greedy exactness, seeded reproducibility, filtering, distribution."""

from __future__ import annotations

import pytest
import torch

from pipeline.gpu_worker.sampling import sampler
from pipeline.gpu_worker.sampling.sampler import sample

VOCAB = 300


def params(n, temperature=1.0, top_p=1.0, top_k=0, seed=0, position=0):
    """Per-row sampling parameters; scalars are broadcast, lists taken as is."""

    def col(value, dtype):
        return torch.tensor(value if isinstance(value, list) else [value] * n, dtype=dtype)

    return (
        col(temperature, torch.float32),
        col(top_p, torch.float32),
        col(top_k, torch.int32),
        col(seed, torch.int64),
        col(position, torch.int64),
    )


@pytest.fixture()
def logits() -> torch.Tensor:
    return torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_is_argmax(logits):
    assert torch.equal(sample(logits, *params(6, temperature=0.0)), logits.argmax(-1))


def test_greedy_rows_stay_argmax_in_a_sampled_batch(logits):
    tokens = sample(logits, *params(6, temperature=[0.0, 1.5, 0.0, 2.0, 1.0, 0.0], seed=[1, 2, 3, 4, 5, 6]))
    greedy = logits.argmax(-1)
    assert tokens[[0, 2, 5]].tolist() == greedy[[0, 2, 5]].tolist()
    assert tokens.dtype == torch.int64


def test_top_k_one_and_tiny_top_p_are_greedy(logits):
    greedy = logits.argmax(-1)
    seeds = list(range(6))
    assert torch.equal(sample(logits, *params(6, temperature=5.0, top_k=1, seed=seeds)), greedy)
    assert torch.equal(sample(logits, *params(6, temperature=5.0, top_p=1e-6, seed=seeds)), greedy)


def test_seeded_sampling_is_reproducible(logits):
    args = params(6, temperature=1.0, top_p=0.9, top_k=50, seed=[11, 12, 13, 14, 15, 16], position=7)
    assert torch.equal(sample(logits, *args), sample(logits, *args))


def test_seeded_row_independent_of_batch(logits):
    """Row 2 alone, in its batch, reversed, and beside other parameters: same token."""
    row = dict(temperature=1.3, top_p=0.8, top_k=40, seed=1234, position=5)
    alone = sample(logits[2:3], *params(1, **row))
    for trial in range(20):
        # Vary the draws so a coincidence cannot hide a dependence.
        others = dict(
            temperature=[0.7, 0.0, 1.3, 2.0, 1.0, 0.5],
            top_p=[1.0, 1.0, 0.8, 0.5, 0.95, 1.0],
            top_k=[0, 3, 40, 0, 100, 7],
            seed=[trial, 9, 1234, 3, 4, 5],
            position=[1, 2, 5, 4, 3, 0],
        )
        batch = sample(logits, *params(6, **others))
        reversed_batch = sample(logits.flip(0), *(p.flip(0) for p in params(6, **others))).flip(0)
        assert batch[2] == alone[0] == reversed_batch[2]


def test_seed_and_position_change_the_draw(logits):
    flat = torch.zeros(1, VOCAB)
    by_seed = {int(sample(flat, *params(1, seed=s))) for s in range(20)}
    by_position = {int(sample(flat, *params(1, seed=1, position=p))) for p in range(20)}
    assert len(by_seed) > 10 and len(by_position) > 10


def draws(logits_row, n=3000, **kw):
    rows = logits_row.expand(n, -1)
    return sample(rows, *params(n, seed=list(range(n)), **kw))


def test_distribution_follows_softmax():
    logits_row = torch.tensor([0.0, 1.0, 2.0, 3.0])
    freq = torch.bincount(draws(logits_row), minlength=4) / 3000
    torch.testing.assert_close(freq, logits_row.softmax(-1), atol=0.03, rtol=0)


def test_temperature_changes_spread():
    logits_row = torch.linspace(0, 4, 20)
    share_of_top = {}
    for temperature in (0.05, 0.2, 1.0, 5.0):
        tokens = draws(logits_row, temperature=temperature)
        share_of_top[temperature] = (tokens == 19).float().mean().item()
        if temperature == 5.0:
            assert len(set(tokens.tolist())) == 20
    assert share_of_top[0.05] > 0.95
    assert share_of_top[0.05] > share_of_top[0.2] > share_of_top[1.0] > share_of_top[5.0]
    assert share_of_top[5.0] < 0.15


def test_top_k_and_top_p_restrict_support():
    logits_row = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])  # probs ~ .64 .24 .09 .03 .01
    assert set(draws(logits_row, top_k=2).tolist()) == {0, 1}
    # Smallest set reaching 0.8: tokens 0 and 1 (0.64 + 0.24).
    assert set(draws(logits_row, top_p=0.8).tolist()) == {0, 1}
    # top-p applies to what top-k kept: renormalised .73/.27, 0.7 keeps token 0 only.
    assert set(draws(logits_row, top_k=2, top_p=0.7).tolist()) == {0}


def test_large_nucleus_fallback_matches_full_sort(monkeypatch):
    """Rows whose nucleus exceeds the topk candidates give what a full sort gives."""
    vocab = 5000
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(1)) * 0.5
    args = params(
        8,
        top_p=[0.95, 0.5, 0.99, 0.9, 0.2, 0.95, 1.0, 0.9],
        top_k=[0, 0, 0, 0, 0, 2000, 0, 10],
        seed=list(range(8)),
    )
    fast = sample(logits, *args)
    monkeypatch.setattr(sampler, "_TOP_P_CANDIDATES", vocab)
    assert torch.equal(fast, sample(logits, *args))


def test_rejects_bad_parameters(logits):
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, *params(6, temperature=-1.0))
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, *params(6, top_p=0.0))
    with pytest.raises(ValueError, match="shape"):
        sample(logits, *params(5))


def test_empty_batch():
    none = torch.empty(0)
    tokens = sample(torch.empty(0, VOCAB), none, none, none.int(), none.long(), none.long())
    assert tokens.shape == (0,) and tokens.dtype == torch.int64


def test_noise_for_all_rows_in_one_go_without_generators(logits, monkeypatch):
    """No torch.Generator per row: the noise is a counter-based hash of (seed, position, token)."""
    args = params(6, temperature=1.0, top_p=0.9, seed=[1, 2, 3, 4, 5, 6], position=[9, 8, 7, 6, 5, 4])
    expected = sample(logits, *args)

    def no_generators(*a, **k):
        raise AssertionError("a per-row generator was created")

    monkeypatch.setattr(torch, "Generator", no_generators)
    assert torch.equal(sample(logits, *args), expected)
    seeds, positions = torch.tensor([5, 2**63 - 1, -1]), torch.tensor([0, 7, 2**31 - 1])
    batch = sampler.uniform_noise(seeds, positions, VOCAB)
    for i in range(3):  # a row's noise does not depend on the other rows
        assert torch.equal(sampler.uniform_noise(seeds[i : i + 1], positions[i : i + 1], VOCAB)[0], batch[i])


def test_uniforms_stay_strictly_inside_0_1():
    """A zero draw would make -log(u) infinite and could hand the row to token 0."""
    u = sampler.bits_to_uniform(torch.tensor([0, 1, 2**31, 2**32 - 1]))
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u < 1).all())
    race = u.log().neg().log()
    assert bool(torch.isfinite(race).all())
    noise = sampler.uniform_noise(torch.arange(64), torch.arange(64) * 3, 4096)
    assert 0 < float(noise.min()) and float(noise.max()) < 1
    assert abs(float(noise.mean()) - 0.5) < 0.01
    hist = torch.histc(noise, bins=16, min=0, max=1) / noise.numel()
    assert float((hist - 1 / 16).abs().max()) < 0.005


def test_only_surviving_token_is_drawn_whatever_the_seed():
    logits_row = torch.full((VOCAB,), -5.0)
    logits_row[0] = -4.0  # token 0 is the runner-up, filtered out by top_k=1
    logits_row[137] = 10.0
    assert set(draws(logits_row, n=2000, top_k=1).tolist()) == {137}
