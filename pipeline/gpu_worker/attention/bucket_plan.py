"""Grouping a step's rows into buckets of similar context and query length, one SDPA call each (docs/design.md,
"Attention backends")."""

from __future__ import annotations

import numpy as np

# A row joins a bucket whose (padded) context is at most SLACK x its own ...
SLACK = 1.25
# ... or at most MIN_PAD tokens longer (short rows: a call costs more than a few padded keys).
MIN_PAD = 64
# Prefill rows also need chunk lengths within SLACK of each other, or MIN_QUERY_PAD apart.
MIN_QUERY_PAD = 16


def plan_buckets(
    context_lens: np.ndarray,
    query_lens: np.ndarray,
    slack: float = SLACK,
    min_pad: int = MIN_PAD,
    min_query_pad: int = MIN_QUERY_PAD,
) -> list[np.ndarray]:
    """Group rows greedily, longest context first, while context and query lengths stay within ``slack`` x (or
    ``min_pad`` / ``min_query_pad`` tokens) of the bucket's longest (``context_lens``, ``query_lens``: ``[R]``, R >= 1).

    Returns int64 arrays of row indices, ascending within a bucket, longest bucket first.
    """
    if query_lens.min() == query_lens.max():
        # Equal queries (decode rows): a bucket opened at context ``top`` takes
        # every next row down to min(top / slack, top - min_pad); one binary
        # search per bucket instead of a Python step per row.
        top = context_lens.max()
        if context_lens.min() >= min(top / slack, top - min_pad):  # one bucket takes every row
            return [np.arange(context_lens.size)]
        order = np.argsort(-context_lens, kind="stable")
        neg = -context_lens[order]  # ascending
        buckets, i = [], 0
        while i < order.size:
            top = -neg[i]
            j = int(np.searchsorted(neg, -min(top / slack, top - min_pad), side="right"))
            buckets.append(np.sort(order[i:j]))
            i = j
        return buckets
    order = np.argsort(-context_lens, kind="stable")
    ctx = context_lens[order].tolist()
    ql = query_lens[order].tolist()
    groups: list[list[int]] = []
    top = q_min = q_max = 0
    for i, (c, q) in enumerate(zip(ctx, ql, strict=True)):
        lo, hi = min(q_min, q), max(q_max, q)
        if groups and (top <= slack * c or top - c <= min_pad) and (hi <= slack * lo or hi - lo <= min_query_pad):
            groups[-1].append(i)
            q_min, q_max = lo, hi
        else:
            groups.append([i])
            top, q_min, q_max = c, q, q
    return [np.sort(order[g]) for g in groups]
