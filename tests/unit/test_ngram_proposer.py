"""Prompt lookup on the device equals a plain reference, row by row, and never reads the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.gpu_worker.spec.ngram_proposer import propose_ngram
from tests.unit.sync_guard import SyncGuard


def reference(seq: list[int], k: int, n_min: int, n_max: int) -> tuple[list[int], int]:
    """The longest suffix n-gram found earlier (latest occurrence), and the k tokens after it, cycling."""
    last = len(seq) - 1
    for n in range(min(n_max, len(seq)), n_min - 1, -1):
        suffix = seq[len(seq) - n :]
        for end in range(last - 1, n - 2, -1):
            if seq[end - n + 1 : end + 1] == suffix:
                follow = seq[end + 1 :]
                return [follow[m % len(follow)] for m in range(k)], k
    return [seq[-1]] * k, 0


def run(seqs: list[list[int]], k: int, n_min: int, n_max: int, width: int | None = None):
    width = width or max(len(s) for s in seqs) + 3
    hist = torch.full((len(seqs), width), 99, dtype=torch.int32)  # garbage past each length
    for i, s in enumerate(seqs):
        hist[i, : len(s)] = torch.tensor(s, dtype=torch.int32)
    drafts, matched = propose_ngram(hist, torch.tensor([len(s) for s in seqs]), k, n_min, n_max)
    return drafts.tolist(), matched.tolist()


def test_examples():
    seqs = [
        [1, 2, 3, 4, 5, 6, 1, 2, 3],  # "1 2 3" earlier: 4 5 6 follow
        [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7],  # latest occurrence of "5 6 7" is followed by 9
        [1, 2, 3, 4],  # nothing repeats: filler
        [7, 7, 7],  # a loop of period 1
        [3, 1, 2, 3, 1, 2, 3],  # period 3 through the end
        [4],  # one token
        [1, 2, 9, 1, 2, 8, 3, 2],  # only a 1-gram repeats: below n_min 2
    ]
    drafts, matched = run(seqs, 3, 2, 4)
    assert drafts[0] == [4, 5, 6] and matched[0] == 3
    assert drafts[1] == [9, 5, 6]
    assert drafts[2] == [4, 4, 4] and matched[2] == 0
    assert drafts[3] == [7, 7, 7] and matched[3] == 3
    assert drafts[4] == [1, 2, 3]
    assert drafts[5] == [4, 4, 4] and matched[5] == 0
    assert matched[6] == 0


@pytest.mark.parametrize("n_min,n_max,k", [(1, 1, 1), (2, 5, 4), (3, 3, 7), (1, 6, 2)])
def test_random_histories_match_the_reference(n_min, n_max, k):
    rng = np.random.default_rng(n_min * 10 + n_max)
    seqs = []
    for _ in range(300):
        n = int(rng.integers(1, 60))
        s = rng.integers(0, 6, n).tolist()  # a small alphabet: many repeats
        if n > 10 and rng.random() < 0.5:  # plant a copy of an earlier stretch at the end
            a = int(rng.integers(0, n - 8))
            s += s[a : a + int(rng.integers(2, 8))]
        seqs.append(s)
    drafts, matched = run(seqs, k, n_min, n_max)
    for s, d, m in zip(seqs, drafts, matched, strict=True):
        assert (d, m) == reference(s, k, n_min, n_max), s


def test_no_host_sync():
    g = SyncGuard()
    with g:
        hist = torch.randint(0, 5, (8, 40), dtype=torch.int32, device="cpu")
        lengths = torch.randint(1, 41, (8,), device="cpu")
        propose_ngram(hist, lengths, 4, 2, 5)
    assert g.violations == []
