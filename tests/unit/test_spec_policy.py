"""The speculation policy drafts when measured acceptance beats measured cost, and only then."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.scheduler_proc.spec_policy import SpecPolicy, SpecStats

K = 4


def train(policy: SpecPolicy, cost_ns, rows: int, accepted_of_k, steps: int = 60, budget: int = 10_000) -> list[int]:
    """Run ``steps`` decode steps of ``rows`` rows: the step costs ``cost_ns(tokens)``, a row with ``k``
    drafts accepts ``accepted_of_k(k)``, drafts take at most ``budget`` tokens. Returns each step's k."""
    ks = []
    req = np.arange(rows)
    for _ in range(steps):
        k, chosen = policy.choose(rows, rows, req, np.full(rows, 1000), budget=budget)
        ks.append(k)
        policy.observe_step(rows + k * len(chosen), int(cost_ns(rows + k * len(chosen))))
        for r in req:
            drafted = k if r in chosen else 0
            policy.observe_row(int(r), drafted, accepted_of_k(drafted), matched=True)
    return ks


def test_free_drafts_that_are_accepted_are_always_taken():
    ks = train(SpecPolicy(64, K), lambda t: 10_000_000, 64, lambda k: k)
    assert ks[-20:] == [K] * 20


@pytest.mark.parametrize(("budget", "most_idle"), [(200, 0), (20, 10)])
def test_free_drafts_are_taken_when_they_add_less_than_the_step(budget, most_idle):
    """256 rows, ``budget`` tokens for drafts, each draft accepted with probability 0.7: steps of 256 tokens and
    of up to 256 + ``budget`` cost the same, and the cost curve must tell them apart. With the buckets' mean
    points alone the steps without drafts looked cheaper than they are, and the policy drafted nothing in 50
    (budget 200, one bucket per doubling) and 37 (budget 20, one or four) of the last 150 steps; with each
    bucket's line in at most ``most_idle`` (when every drafting step has the same tokens, the line fades with
    the last step without drafts: about one step in 20)."""
    rng = np.random.default_rng(0)

    def accepted(k):  # the leading drafts accepted, each with probability 0.7
        return int(np.argmin(np.append(rng.random(k) < 0.7, False)))

    ks = train(SpecPolicy(256, K), lambda t: 10_000_000, 256, accepted, steps=200, budget=budget)
    assert sum(k == 0 for k in ks[-150:]) <= most_idle, ks


def test_cost_follows_each_buckets_line():
    """Steps of 256-300 tokens whose time grows 1 us a token: the line inside their bucket, not the mean point."""
    p = SpecPolicy(8, K)
    for t in (256, 300, 270, 256, 290, 280):
        p.observe_step(t, 5_000_000 + 1_000 * t)
    assert p.cost(np.array([256, 300])) == pytest.approx([5_256_000, 5_300_000])


def test_drafts_that_cost_their_tokens_are_never_worth_it():
    """A compute-bound device (time proportional to tokens): even perfect drafts only break even."""
    ks = train(SpecPolicy(64, K), lambda t: 1_000_000 * t, 64, lambda k: k)
    assert ks[-20:] == [0] * 20


def test_rejected_drafts_stop_being_tried():
    ks = train(SpecPolicy(8, K), lambda t: 10_000_000 + 100_000 * t, 8, lambda k: 0, steps=200)
    assert sum(k > 0 for k in ks[-100:]) <= 10  # now and then a retry, as the evidence fades


def test_memory_bound_small_batch_drafts_a_compute_bound_large_one_does_not():
    """A concave cost (flat while memory-bound, then linear): drafting pays at batch 1, not at 256."""

    def cost(t):
        return 20_000_000 + 1_000_000 * max(0, t - 32)

    assert train(SpecPolicy(256, K), cost, 1, lambda k: k * 3 // 4)[-10:] == [K] * 10
    assert train(SpecPolicy(256, K), cost, 256, lambda k: k * 3 // 4)[-10:] == [0] * 10


def test_unmatched_rows_remaining_and_budget():
    p = SpecPolicy(8, K)
    p.observe_step(8, 1_000_000)
    p.observe_step(40, 1_000_000)
    for r in range(8):
        p.observe_row(r, K, K, matched=r != 3)  # row 3's proposer found nothing for its next step
    k, rows = p.choose(8, 8, np.arange(8), np.array([100, 100, 100, 100, 100, 100, 3, 2]), budget=100)
    assert k == K and 3 not in rows and 6 not in rows and 7 not in rows
    k, rows = p.choose(8, 8, np.arange(8), np.full(8, 100), budget=8)
    assert k * len(rows) <= 8 and len(rows) > 0


def test_stats_count_drafts_tokens_and_acceptance_by_position():
    """vLLM's counts: a row with k >= 1 drafts is a draft; accepted_per_pos[p] counts rows accepting p + 1 or more."""
    rng = np.random.default_rng(0)
    stats = SpecStats(K)
    rows = []
    for _ in range(5):
        k = rng.integers(0, K + 1, 50)
        accepted = (rng.random(50) * (k + 1)).astype(np.int64)
        stats.add(k, accepted)
        rows += zip(k.tolist(), accepted.tolist())
    assert stats.num_drafts == sum(k > 0 for k, _ in rows)
    assert stats.num_draft_tokens == sum(k for k, _ in rows)
    assert stats.num_accepted_tokens == sum(a for _, a in rows)
    assert stats.accepted_per_pos.tolist() == [sum(a > p for _, a in rows) for p in range(K)]
