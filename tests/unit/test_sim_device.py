"""The simulated device behaves like a CUDA stream and its tokens are deterministic."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pipeline.common.step_output import MAX_LOGPROBS
from pipeline.gpu_worker.sim_device import SimEvent, SimulatedDevice, sim_drafts, sim_logprobs, sim_next_tokens


def test_enqueue_returns_at_once_and_runs_in_order():
    dev = SimulatedDevice(step_us=20_000, token_us=100)
    t0 = time.monotonic_ns()
    s1, e1 = dev.enqueue_step(10)
    s2, e2 = dev.enqueue_step(0)
    assert time.monotonic_ns() - t0 < 5_000_000  # returned long before the work "ran"
    assert e1 - s1 == 20_000_000 + 10 * 100_000
    assert s2 == e1 and e2 - s2 == 20_000_000  # queued behind the first, no gap
    ev = SimEvent(e2)
    assert not ev.query()
    ev.synchronize()
    assert ev.query() and time.monotonic_ns() >= e2


def test_idle_device_starts_work_when_enqueued():
    dev = SimulatedDevice(step_us=1000, token_us=0)
    _, e1 = dev.enqueue_step(1)
    SimEvent(e1).synchronize()
    time.sleep(0.005)
    before = time.monotonic_ns()
    s2, _ = dev.enqueue_step(1)
    assert s2 >= before and s2 - e1 >= 5_000_000  # the idle time is a gap, not absorbed


def test_negative_times_rejected():
    with pytest.raises(ValueError):
        SimulatedDevice(step_us=-1, token_us=0)


def test_tokens_are_deterministic_words_of_the_chain():
    x = np.array([5, 5, 7], dtype=np.int64)
    p = np.array([10, 11, 10], dtype=np.int64)
    a, b = sim_next_tokens(x, p), sim_next_tokens(x.copy(), p.copy())
    assert (a == b).all()
    assert a[0] != a[1] and a[0] != a[2]  # depends on both the input token and the position
    assert ((a >= 1000) & (a < 9000)).all()


def test_sim_logprobs_are_plausible_and_depend_only_on_inputs():
    rng = np.random.default_rng(1)
    x, p = rng.integers(0, 49152, 64), rng.integers(0, 1000, 64)
    predicted = sim_next_tokens(x, p)
    targets = np.where(rng.random(64) < 0.5, predicted, rng.integers(0, 49152, 64))
    lp, top_ids, top_lp = sim_logprobs(x, p, targets)
    assert lp.dtype == np.float32 and top_ids.shape == top_lp.shape == (64, MAX_LOGPROBS)
    assert np.isfinite(lp).all() and np.isfinite(top_lp).all() and (lp <= 0).all()
    assert (top_lp[:, :-1] > top_lp[:, 1:]).all() and (top_ids[:, 0] == predicted).all()
    assert (lp[targets == predicted] == top_lp[targets == predicted, 0]).all()
    assert (lp[targets != predicted] <= top_lp[targets != predicted, -1]).all()
    assert all(len(set(row)) == MAX_LOGPROBS for row in top_ids.tolist())
    # Row by row the same values in any batch.
    lp1, ids1, top1 = sim_logprobs(x[5:6], p[5:6], targets[5:6])
    assert lp1[0] == lp[5] and (ids1[0] == top_ids[5]).all() and (top1[0] == top_lp[5]).all()


@pytest.mark.parametrize("acceptance", [0.0, 0.3, 0.8, 1.0])
def test_drafts_follow_the_chain_with_the_configured_probability(acceptance):
    """Each draft is the chain's token at its place with probability ``acceptance``, decided by a hash, so
    a row's accepted run (its leading right drafts) is geometric."""
    rng = np.random.default_rng(0)
    last = rng.integers(1000, 9000, 4000)
    pos = rng.integers(0, 900, 4000)
    k = 4
    drafts = sim_drafts(last, pos, k, acceptance)
    truth, token = np.empty_like(drafts), last
    for i in range(k):
        token = truth[:, i] = sim_next_tokens(token, pos + i)
    right = drafts == truth
    assert abs(right.mean() - acceptance) < 0.02
    run = np.where(right.all(1), k, np.argmin(right, 1))  # leading right drafts
    expected = [(1 - acceptance) * acceptance**n for n in range(k)] + [acceptance**k]
    assert np.abs(np.bincount(run, minlength=k + 1) / len(run) - expected).max() < 0.02
    assert ((drafts >= 1000) & (drafts < 9000)).all()
    assert np.array_equal(drafts, sim_drafts(last.copy(), pos.copy(), k, acceptance))  # deterministic
