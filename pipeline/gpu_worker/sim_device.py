"""The simulated device: a CUDA-stream stand-in for measuring host overhead.

It replaces only the forward pass and the sampling kernel (docs/design.md, "The simulated device"). Work enqueued on it
returns at once and runs in order "in the background": a step enqueued at host time ``t`` starts at ``max(t, end of the
previous step)`` and lasts ``step_us + token_us × tokens`` microseconds. The timeline is computed, not slept through, so
no thread competes with the worker's host code for the GIL or a core; only waiting for an event sleeps, until the time
that event completes.

Tokens are deterministic: the token sampled after position ``p`` whose input token is ``x`` is a hash of ``(x, p)``,
mapped onto ordinary words of the real vocabulary. Every token therefore depends on the whole chain before it, so a
placeholder resolved to a wrong token changes all later output, which is what the async-equals-sync tests need to see.
Its log-probabilities are stand-ins derived the same way (``sim_logprobs``).

With speculative decoding its drafts (``sim_drafts``) are the chain's own next tokens, each right with a configured
probability and decided by a hash, so that the token gap and the accepted lengths can be measured without a model;
verification is the real comparison with the chain's tokens.
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
    """An in-order stream whose kernels take ``step_us + token_us × num_tokens``.

    Args:
        step_us: fixed cost of one step, microseconds (the A of A + B·tokens).
        token_us: cost per token in the step, microseconds (the B).
    """

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
    """Deterministic "sampled" tokens.

    Args:
        last_input_ids: ``[S]`` int64, input token at each sampled row's last position.
        last_positions: ``[S]`` int64, that position.

    Returns:
        ``[S]`` int64 token ids in ``SIM_WORD_ID_RANGE``.
    """
    return _word(_hash2(last_input_ids, last_positions))


def _word(h: np.ndarray) -> np.ndarray:
    return (h % np.uint64(_NUM_WORD_IDS)).astype(np.int64) + _FIRST_WORD_ID


def sim_drafts(last_ids: np.ndarray, last_positions: np.ndarray, k: int, acceptance: float) -> np.ndarray:
    """``[R, k]`` int64 drafts continuing each row: draft ``i`` is the chain's ``i``-th next token after the row's last
    when the high half of that token's hash falls below ``acceptance``, else the word beside it, which verification
    rejects (and with it every later draft: a row accepts its leading right drafts).

    Args:
        last_ids: ``[R]`` int64, each row's last token (the newest sampled).
        last_positions: ``[R]`` int64, its position.
        k: drafts per row.
        acceptance: the probability in [0, 1] that each draft is the chain's token.
    """
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
    """Deterministic stand-in log-probabilities of ``targets``, each following (input token, position).

    The simulated model's most likely token after ``(x, p)`` is ``sim_next_tokens``'s, with a log-probability in (-1.05,
    -0.05] hashed from ``(x, p)``; its other ``MAX_LOGPROBS - 1`` alternatives are distinct word ids, each 0.5 below the
    previous. A target among them gets its listed value, any other a value below all of them. Like the real values they
    depend only on the inputs, never on the batch.

    Args:
        input_ids: ``[N]`` int64, the token at the predicting position.
        positions: ``[N]`` int64, that position.
        targets: ``[N]`` int64, the token whose log-probability is wanted.

    Returns:
        ``(logprob [N] float32, top_ids [N, MAX_LOGPROBS] int32,
        top_logprobs [N, MAX_LOGPROBS] float32)``: finite, at most 0, top
        entries in descending order.
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
