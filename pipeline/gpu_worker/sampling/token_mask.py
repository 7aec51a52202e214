"""Structured output on the device: a packed token bitmask applied to the logits before sampling.

The scheduler sends, per constrained sampled row, the tokens its grammar allows as ``ceil(V / 32)`` int32 words
(docs/design.md, "Structured output"); this module turns them into ``-inf`` on the sampler's copy of the logits, so a
rejected token is never drawn, greedy or sampled. The raw logits stay as they are for the log-probabilities. The bit
layout is llguidance's and xgrammar's: token ``t`` is allowed iff bit ``t % 32`` of word ``t // 32`` is set.
"""

from __future__ import annotations

import numpy as np
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
    """The simulated device's masked draw: ``tokens`` with each constrained row's token replaced by the allowed token
    nearest to it (the lower one on a tie); a row that allows nothing keeps its own.

    Host arrays only (the simulated device's tensors live on the CPU). A row whose own token is allowed costs a bit
    test; only the others unpack their mask, so 256 rows take a fraction of a 2 ms step.

    Args:
        tokens: ``[S]`` int64 (changed in place and returned).
        rows, bitmask: as ``apply_token_bitmask``.
    """
    out, rows_np = tokens.numpy(), rows.numpy()
    words = bitmask.numpy().astype(np.uint32)  # the low 32 bits of each widened word
    drawn = out[rows_np]
    own = (words[np.arange(len(rows_np)), drawn // MASK_BITS] >> (drawn % MASK_BITS).astype(np.uint32)) & 1
    for i in np.flatnonzero(own == 0):
        nearest = _nearest_bit(words[i], int(drawn[i]))
        if nearest >= 0:
            out[rows_np[i]] = nearest
    return tokens


def _nearest_bit(words: np.ndarray, t: int) -> int:
    """The set bit of ``words`` (``[W]`` uint32, bit ``t % 32`` of word ``t // 32`` is ``t``) nearest to ``t``, the
    lower on a tie, with ``t`` itself not set; -1 if none is set."""
    w, b = divmod(t, MASK_BITS)
    below = int(words[w]) & ((1 << b) - 1)
    above = int(words[w]) >> (b + 1) << (b + 1)
    nonzero = np.flatnonzero(words)
    if not below:  # the highest set bit of the nearest word before
        k = np.searchsorted(nonzero, w) - 1
        w_low, below = (int(nonzero[k]), int(words[nonzero[k]])) if k >= 0 else (w, 0)
    else:
        w_low = w
    if not above:  # the lowest set bit of the nearest word after
        k = np.searchsorted(nonzero, w, side="right")
        w_high, above = (int(nonzero[k]), int(words[nonzero[k]])) if k < len(nonzero) else (w, 0)
    else:
        w_high = w
    lower = w_low * MASK_BITS + below.bit_length() - 1 if below else -1
    upper = w_high * MASK_BITS + (above & -above).bit_length() - 1 if above else -1
    if lower < 0 or (upper >= 0 and upper - t < t - lower):
        return upper
    return lower
