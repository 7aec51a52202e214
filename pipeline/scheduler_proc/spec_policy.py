"""How many drafts each step verifies, and for which rows (docs/design.md, "Speculative decoding").

Both sides are measured: acceptance per request (geometric, exponential forgetting, a global prior), and step cost per
bucket of token counts (least-squares inside, interpolated between). Each step keeps the ``k`` with the best expected
tokens per second, 0 when none beats verifying nothing.
"""

from __future__ import annotations

import math

import numpy as np

# Forgetting of a request's acceptance evidence per verified row, and of the cost buckets per step.
_ROW_DECAY = 0.8
_BUCKET_DECAY = 0.9
# Evidence fades while a candidate row does not draft, so it is retried now and then.
_IDLE_DECAY = 0.97
# Cost buckets per doubling of the token count.
_BUCKETS_PER_DOUBLING = 4


class SpecPolicy:
    """Chooses each step's drafts per row (0 or the step's ``k``) from measured acceptance and cost.

    ``prior_weight``: drafts' worth of evidence the prior counts for; ``adaptive`` False: every matched candidate drafts
    ``k_max`` (``--speculative-policy always``).
    """

    def __init__(
        self, max_num_seqs: int, k_max: int, prior: float = 0.6, prior_weight: float = 2.0, adaptive: bool = True
    ):
        self.k_max, self.adaptive = k_max, adaptive
        self.prior_weight = prior_weight
        # Per req_index: accepted drafts and rejections (rows that stopped before their last draft).
        self.accepted = np.zeros(max_num_seqs)
        self.rejected = np.zeros(max_num_seqs)
        self.matched = np.ones(max_num_seqs, dtype=bool)
        self._global = np.array([prior * 10, (1 - prior) * 10])
        # Cost buckets: bucket b holds steps of 2**(b / 4) to 2**((b + 1) / 4) tokens; their mean tokens and
        # ns, and the sums of squares and products of their deviations (tokens, tokens x ns), for the line.
        n = 32 * _BUCKETS_PER_DOUBLING
        self._bucket_tokens, self._bucket_ns, self._bucket_weight = np.zeros(n), np.zeros(n), np.zeros(n)
        self._bucket_tt, self._bucket_tn = np.zeros(n), np.zeros(n)
        # The cost's points (tokens, ns), from (0, 0), and each bucket's slope (NaN: no line); None: stale.
        self._curve: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._ks = np.arange(1, k_max + 1)[:, None]

    def reset(self, req_index: int) -> None:
        """A new request at ``req_index``: no evidence of its own yet."""
        self.accepted[req_index] = self.rejected[req_index] = 0.0
        self.matched[req_index] = True

    def acceptance(self, req_indices: np.ndarray) -> np.ndarray:
        """``[N]`` estimated per-draft acceptance of the requests at ``req_indices``."""
        g = self._global[0] / self._global.sum()
        w = self.prior_weight
        a, r = self.accepted[req_indices], self.rejected[req_indices]
        return (a + g * w) / (a + r + w)

    def observe_row(self, req_index: int, k: int, accepted: int, matched: bool) -> None:
        """A row's verified output: ``accepted`` of its ``k`` drafts (``k`` 0: it verified none); ``matched``: its
        proposer found drafts for its next step."""
        self.observe_rows(np.array([req_index]), np.array([k]), np.array([accepted]), np.array([matched]))

    def observe_rows(
        self, req_indices: np.ndarray, k: np.ndarray, accepted: np.ndarray, matched: np.ndarray | None = None
    ) -> None:
        """``observe_row`` for many rows (``[N]`` arrays, distinct ``req_indices``); ``matched`` None: set apart (in
        ``self.matched``)."""
        if matched is not None:
            self.matched[req_indices] = matched
        v = k > 0
        if not v.any():
            return
        idx, a = req_indices[v], accepted[v]
        stopped = (a < k[v]).astype(np.float64)
        self.accepted[idx] = self.accepted[idx] * _ROW_DECAY + a
        self.rejected[idx] = self.rejected[idx] * _ROW_DECAY + stopped
        self._global = self._global * 0.99 ** len(idx) + [a.sum(), stopped.sum()]

    def observe_step(self, num_tokens: int, device_ns: int) -> None:
        """A step of ``num_tokens`` took ``device_ns`` on the device."""
        if num_tokens <= 0 or device_ns <= 0:
            return
        b = int(math.log2(num_tokens) * _BUCKETS_PER_DOUBLING)
        w = self._bucket_weight[b] * _BUCKET_DECAY + 1
        # Weighted means and co-moments, updated in one pass (West 1979), old steps fading by _BUCKET_DECAY.
        dt = num_tokens - self._bucket_tokens[b]
        self._bucket_tokens[b] += dt / w
        self._bucket_ns[b] += (device_ns - self._bucket_ns[b]) / w
        self._bucket_tt[b] = self._bucket_tt[b] * _BUCKET_DECAY + dt * (num_tokens - self._bucket_tokens[b])
        self._bucket_tn[b] = self._bucket_tn[b] * _BUCKET_DECAY + dt * (device_ns - self._bucket_ns[b])
        self._bucket_weight[b] = w
        self._curve = None  # drawn again when next asked (choose runs once in a few steps)

    def cost(self, num_tokens: np.ndarray) -> np.ndarray:
        """Estimated device ns of steps of ``num_tokens`` (any shape); 1 before any step is measured.

        Least-squares line inside a measured bucket, interpolated between, flat past the largest, proportional below the
        smallest: both guesses flatter the untried side, so it gets tried.
        """
        if self._curve is None:
            seen = self._bucket_weight > 0
            if not seen.any():
                return np.ones(np.shape(num_tokens))
            # A line needs the steps' tokens to spread by a token or more (variance >= 1).
            spread = self._bucket_tt >= np.maximum(self._bucket_weight, 1e-9)
            slope = np.full(len(spread), np.nan)
            slope[spread] = np.maximum(0.0, self._bucket_tn[spread] / self._bucket_tt[spread])
            # From (0, 0): below the smallest bucket the cost is proportional to the tokens.
            self._curve = (
                np.concatenate([[0.0], self._bucket_tokens[seen]]),
                np.concatenate([[0.0], np.maximum.accumulate(self._bucket_ns[seen])]),
                slope,
            )
        tokens, ns, slope = self._curve
        t = np.asarray(num_tokens, dtype=np.float64)
        out = np.interp(t, tokens, ns)
        b = (np.log2(np.maximum(t, 1.0)) * _BUCKETS_PER_DOUBLING).astype(np.int64)
        s = slope[b]
        line = ~np.isnan(s)
        if line.any():
            out[line] = (self._bucket_ns[b] + s * (t - self._bucket_tokens[b]))[line]
        return out

    def choose(
        self,
        num_sampled: int,
        base_tokens: int,
        req_indices: np.ndarray,
        remaining: np.ndarray,
        budget: int,
        idle_steps: int = 1,
    ) -> tuple[int, np.ndarray]:
        """This step's drafts: ``(k, rows)``, the candidates (indices into ``req_indices``, ``[C]``) that verify ``k``.

        ``remaining`` (``[C]``) allows at most ``remaining - 1`` drafts; ``idle_steps``: the unchosen candidates'
        evidence fades by ``_IDLE_DECAY`` this many times.
        """
        best_k, best_rows = 0, np.zeros(0, dtype=np.int64)
        if not self.adaptive:
            k = self.k_max
            rows = np.flatnonzero((remaining > k) & self.matched[req_indices])[: budget // k]
            return (k, rows) if len(rows) else (0, best_rows)
        if len(req_indices) and budget > 0:
            a = self.acceptance(req_indices) * self.matched[req_indices]
            # A row's gain a + a^2 + ... + a^k grows with a for every k: one order serves every k.
            order = np.argsort(-a, kind="stable")
            a, remaining, ks = a[order], remaining[order], self._ks
            # [K, C]: row k - 1 is k drafts; a candidate takes part while it may take k more tokens
            # and its acceptance is not 0, the first budget // k of those by gain.
            gain = np.cumsum(a**ks, axis=0)
            ok = (remaining > ks) & (a > 0)
            n = np.cumsum(ok, axis=1)
            ok &= n <= budget // ks
            # Expected tokens per ns over verifying nothing, for the first n rows by gain.
            cost = self.cost(np.append(base_tokens, base_tokens + ks * n))
            rate = (num_sampled + np.cumsum(gain * ok, axis=1)) / cost[1:].reshape(n.shape) - num_sampled / cost[0]
            rate[~ok] = -np.inf
            best = int(rate.argmax())
            k, m = divmod(best, len(a))
            if rate[k, m] > 0:
                best_k, best_rows = k + 1, order[np.flatnonzero(ok[k, : m + 1])]
        if idle_steps:
            self._idle(np.delete(req_indices, best_rows), _IDLE_DECAY**idle_steps)
        return best_k, np.sort(best_rows)

    def _idle(self, req_indices: np.ndarray, decay: float) -> None:
        self.accepted[req_indices] *= decay
        self.rejected[req_indices] *= decay


class SpecStats:
    """Speculative decoding's cumulative counts (vLLM's ``spec_decode_*``), kept as a (drafts, accepted) histogram per
    row."""

    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = k = num_speculative_tokens
        self._hist = np.zeros((k + 1, k + 1), np.int64)  # [drafts, accepted]: rows

    def add(self, k: np.ndarray, accepted: np.ndarray) -> None:
        """Rows that verified ``k`` drafts (``[N]``, 0: none) and accepted ``accepted`` of them."""
        n = self.num_speculative_tokens + 1
        self._hist += np.bincount(k * n + accepted, minlength=n * n).reshape(n, n)

    @property
    def num_drafts(self) -> int:
        return int(self._hist[1:].sum())

    @property
    def num_draft_tokens(self) -> int:
        return int(self._hist.sum(1) @ np.arange(self.num_speculative_tokens + 1))

    @property
    def num_accepted_tokens(self) -> int:
        return int(self._hist.sum(0) @ np.arange(self.num_speculative_tokens + 1))

    @property
    def accepted_per_pos(self) -> np.ndarray:
        """``[K]``: rows whose draft at each position was accepted (those that accepted more than it)."""
        rows_accepting = self._hist[1:].sum(0)  # by accepted count
        return rows_accepting[::-1].cumsum()[::-1][1:]


def output_runs(req_nums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the runs of equal request numbers in a StepOutput's rows (``[rows]``): with speculation
    a request's tokens of one step are consecutive rows."""
    if not len(req_nums):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate([[True], req_nums[1:] != req_nums[:-1]]))
    return starts, np.diff(np.append(starts, len(req_nums)))
