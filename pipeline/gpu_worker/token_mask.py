"""Structured output on the device: a packed token bitmask applied to the logits before sampling.

The scheduler sends, per constrained sampled row, the tokens its grammar
allows as ``ceil(V / 32)`` int32 words (docs/design.md, "Structured
output"); this module turns them into ``-inf`` on the sampler's copy of the
logits, so a rejected token is never drawn, greedy or sampled. The raw
logits stay as they are for the log-probabilities. The bit layout is
llguidance's and xgrammar's: token ``t`` is allowed iff bit ``t % 32`` of
word ``t // 32`` is set.
"""

from __future__ import annotations

import torch

from pipeline.common.step_protocol import MASK_BITS


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor | None) -> torch.Tensor:
    """The logits the sampler should see: ``logits`` itself without masks, else a masked copy.

    Args:
        logits: ``[S, V]`` float32 logits of the sampled rows (left unchanged).
        rows: ``[M]`` int64 on the device, the constrained rows among the ``S``; None for none.
        bitmask: ``[M, W]`` int64 (int32 words, widened) on the device, ``W >= ceil(V / 32)``.

    Returns:
        ``[S, V]`` float32 where each constrained row's disallowed tokens are
        ``-inf``. Never waits for the device.
    """
    if rows is None:
        return logits
    vocab = logits.shape[1]
    shifts = torch.arange(MASK_BITS, device=logits.device, dtype=bitmask.dtype)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    x = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, rows, x)


def nearest_allowed(tokens: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The simulated device's masked draw: ``tokens`` with each constrained row's token replaced by the
    allowed token nearest to it (the lower one on a tie); a row that allows nothing keeps its own.

    Args:
        tokens: ``[S]`` int64 (changed in place and returned).
        rows, bitmask: as ``apply_token_bitmask``.
    """
    shifts = torch.arange(MASK_BITS, dtype=bitmask.dtype)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()
    drawn = tokens.index_select(0, rows)
    distance = (torch.arange(allowed.shape[1])[None, :] - drawn[:, None]).abs().masked_fill_(~allowed, 2**62)
    best = distance.argmin(1)
    return tokens.index_copy_(0, rows, torch.where(allowed.any(1), best, drawn))
