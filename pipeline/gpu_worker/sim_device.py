"""The simulated device: a CUDA-stream stand-in for measuring host overhead (docs/design.md, "The simulated device").

A step enqueued at ``t`` runs from ``max(t, previous end)`` for ``step_us + token_us × tokens`` us, computed, not slept.
Tokens hash ``(input token, position)`` onto real words, so a wrongly resolved placeholder changes all later output;
drafts (``sim_drafts``) are right with a configured probability.
"""

from __future__ import annotations

import time

import numpy as np

from pipeline.common.constants import SIM_WORD_ID_RANGE
from pipeline.common.step_output import MAX_LOGPROBS

_FIRST_WORD_ID = SIM_WORD_ID_RANGE[0]
_NUM_WORD_IDS = SIM_WORD_ID_RANGE[1] - SIM_WORD_ID_RANGE[0]


class SimEvent:
    """Completes at a known monotonic time; mirrors ``torch.cuda.Event``'s query/synchronize."""

    __slots__ = ("time_ns",)

    def __init__(self, time_ns: int):
        self.time_ns = time_ns

    def query(self) -> bool:
        """True once the simulated stream has passed this event."""
        return time.monotonic_ns() >= self.time_ns

    def synchronize(self) -> None:
        """Sleep until the event completes."""
        wait = self.time_ns - time.monotonic_ns()
        if wait > 0:
            time.sleep(wait / 1e9)


class SimulatedDevice:
    """An in-order stream whose kernels take ``step_us + token_us × num_tokens`` microseconds."""

    def __init__(self, step_us: float, token_us: float):
        if step_us < 0 or token_us < 0:
            raise ValueError("simulated step and token times must be >= 0")
        self.step_ns, self.token_ns = int(step_us * 1000), int(token_us * 1000)
        self._busy_until = 0

    def enqueue_step(self, num_tokens: int) -> tuple[int, int]:
        """Enqueue one step; returns its simulated (start_ns, end_ns) on the monotonic clock."""
        start = max(time.monotonic_ns(), self._busy_until)
        self._busy_until = start + self.step_ns + self.token_ns * num_tokens
        return start, self._busy_until


def sim_next_tokens(last_input_ids: np.ndarray, last_positions: np.ndarray) -> np.ndarray:
    """Deterministic "sampled" tokens: ``[S]`` int64 ids in ``SIM_WORD_ID_RANGE`` from each sampled row's last input id
    and position (``[S]`` int64)."""
    return _word(_hash2(last_input_ids, last_positions))


def _word(h: np.ndarray) -> np.ndarray:
    return (h % np.uint64(_NUM_WORD_IDS)).astype(np.int64) + _FIRST_WORD_ID


def sim_drafts(last_ids: np.ndarray, last_positions: np.ndarray, k: int, acceptance: float) -> np.ndarray:
    """``[R, k]`` int64 drafts continuing each row: draft ``i`` is the chain's ``i``-th next token with probability
    ``acceptance`` (by hash), else the word beside it, which verification rejects."""
    # _hash2 of (token, position) along the chain, token i + 1 following token i, in place.
    x = last_ids.astype(np.uint64)
    h = (last_positions.astype(np.uint64)[:, None] + np.arange(k, dtype=np.uint64)) * _C2
    for i in range(k):
        hi = h[:, i]
        hi += x * _C1
        _mix(hi)
        x = hi % np.uint64(_NUM_WORD_IDS) + np.uint64(_FIRST_WORD_ID)
    out = _word(h)
    # A wrong draft is the word beside the right one (the range's bounds are even: it stays inside).
    out ^= (h >> np.uint64(32)) >= np.uint64(min(int(acceptance * 2**32), 2**32))
    return out


_C1, _C2, _C3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _hash2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A uint64 hash of two int arrays, elementwise (a splitmix64-style finalizer)."""
    return _mix(a.astype(np.uint64) * _C1 + b.astype(np.uint64) * _C2)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 ``h``, in place; returns ``h``."""
    h ^= h >> np.uint64(31)
    h *= _C3
    h ^= h >> np.uint64(29)
    return h


def sim_logprobs(
    input_ids: np.ndarray, positions: np.ndarray, targets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic stand-in log-probabilities of ``targets`` (``[N]`` int64), each following (input token, position).

    The top token is ``sim_next_tokens``'s (logprob in (-1.05, -0.05] by hash), alternatives 0.5 apart;
    batch-independent. Returns ``(logprob [N] float32, top_ids [N, MAX_LOGPROBS] int32, top_logprobs [N, MAX_LOGPROBS]
    float32)``.
    """
    h = _hash2(input_ids, positions)
    first = (h % np.uint64(_NUM_WORD_IDS)).astype(np.int64)
    j = np.arange(MAX_LOGPROBS)
    # 7919 is prime to the range's size, so the alternatives are distinct.
    top_ids = ((first[:, None] + 7919 * j) % _NUM_WORD_IDS + _FIRST_WORD_ID).astype(np.int32)
    top0 = -0.05 - (h >> np.uint64(11)).astype(np.int64) % 1000 / 1000
    top_lp = (top0[:, None] - 0.5 * j).astype(np.float32)
    match = top_ids == targets[:, None]
    other = top0 - 0.5 * MAX_LOGPROBS - _hash2(h.astype(np.int64), targets).astype(np.int64) % 1000 / 100
    lp = np.where(match.any(1), top_lp[np.arange(len(h)), match.argmax(1)], other).astype(np.float32)
    return lp, top_ids, top_lp
