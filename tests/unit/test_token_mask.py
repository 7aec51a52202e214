"""The token bitmask on the sampler's logits: a masked token is never sampled, greedy or not."""

import numpy as np
import torch

from pipeline.gpu_worker.sampling.sampler import SamplingPlan, SamplingTensors, sample_rows
from pipeline.gpu_worker.sampling.token_mask import apply_token_bitmask, nearest_allowed

V = 70  # not a multiple of 32: the last word is partly used


def _pack(allowed: np.ndarray) -> torch.Tensor:
    """``[M, V]`` bool -> ``[M, ceil(V / 32)]`` int32 words widened to int64, as the worker uploads them."""
    bits = np.zeros((allowed.shape[0], -(-V // 32) * 32), np.uint8)
    bits[:, :V] = allowed
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).astype(np.int64))


def test_masked_copy_leaves_raw_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g)
    raw = logits.clone()
    allowed = np.random.default_rng(0).random((2, V)) < 0.3
    out = apply_token_bitmask(logits, torch.tensor([1, 3]), _pack(allowed))
    assert torch.equal(logits, raw)
    assert torch.equal(out[[0, 2]], raw[[0, 2]])
    for m, row in enumerate((1, 3)):
        ok = torch.from_numpy(allowed[m])
        assert torch.equal(out[row][ok], raw[row][ok])
        assert torch.isinf(out[row][~ok]).all() and (out[row][~ok] < 0).all()
    assert apply_token_bitmask(logits, None, None) is logits


def test_masked_tokens_never_sampled():
    """Greedy and temperature-1 rows (100 seeds, top-k and top-p) draw only allowed tokens."""
    rng = np.random.default_rng(1)
    s = 8
    logits = torch.from_numpy(rng.normal(size=(s, V)).astype(np.float32) * 3)
    allowed = rng.random((s, V)) < 0.1
    allowed[np.arange(s), rng.integers(0, V, s)] = True  # at least one each
    # The raw argmax is always forbidden, so an unmasked draw would show.
    allowed[np.arange(s), logits.argmax(1).numpy()] = False
    masked = apply_token_bitmask(logits, torch.arange(s), _pack(allowed))
    assert all(allowed[i, t] for i, t in enumerate(masked.argmax(1).tolist()))
    hot = torch.arange(s)
    plan = SamplingPlan.build(hot, np.full(s, 20), np.full(s, 0.9, np.float32), V, host_reads_ok=True)
    for seed in range(100):
        params = SamplingTensors(
            plan, torch.ones(s), torch.full((s,), 0.9), torch.full((s,), 20), torch.zeros(s), torch.full((s,), seed)
        )
        tokens = sample_rows(masked, params, torch.arange(s) + 5)
        assert all(allowed[i, t] for i, t in enumerate(tokens.tolist())), seed


def test_simulated_draw_takes_the_nearest_allowed_token():
    allowed = np.zeros((3, V), bool)
    allowed[0, [3, 40]] = True  # 20 -> 3 (17 away) rather than 40 (20 away)
    allowed[1, [10, 30]] = True  # 20 -> 10 on a tie
    tokens = torch.tensor([20, 20, 20, 66])
    out = nearest_allowed(tokens, torch.tensor([0, 1, 2]), _pack(allowed))
    assert out.tolist() == [3, 10, 20, 66]  # a row allowing nothing keeps its draw; unmasked rows too


def test_simulated_draw_matches_the_nearest_by_distance():
    """Random masks, sparse to dense: each row's draw is the allowed token at the least distance, the lower
    one on a tie, its own where allowed."""
    rng = np.random.default_rng(2)
    for density in (0.0, 0.02, 0.3, 0.95):
        allowed = rng.random((64, V)) < density
        tokens = torch.from_numpy(rng.integers(0, V, 64))
        want = []
        for a, t in zip(allowed, tokens.tolist()):
            ids = np.flatnonzero(a)
            want.append(int(ids[np.argmin(np.abs(ids - t))]) if len(ids) else t)  # argmin: the first, lower
        assert nearest_allowed(tokens, torch.arange(64), _pack(allowed)).tolist() == want, density
