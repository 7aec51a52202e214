"""Structured output on the device: a packed token bitmask applied to a copy of the logits before sampling
(docs/design.md, "Structured output"). Token ``t`` is allowed iff bit ``t % 32`` of word ``t // 32`` is set
(llguidance's and xgrammar's layout)."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.common.step_protocol import MASK_BITS


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor | None) -> torch.Tensor:
    """The ``[S, V]`` float32 logits the sampler should see: ``logits`` itself without masks, else a copy with
    disallowed tokens of ``rows`` (``[M]`` int64) ``-inf``; ``bitmask``: ``[M, W]`` int64-widened words. Never waits for
    the device."""
    if rows is None:
        return logits
    vocab = logits.shape[1]
    shifts = torch.arange(MASK_BITS, device=logits.device, dtype=bitmask.dtype)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    x = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, rows, x)


def nearest_allowed(tokens: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The simulated device's masked draw: ``tokens`` (``[S]`` int64, changed in place) with each constrained row's
    token replaced by the nearest allowed one (lower on a tie; kept if none is allowed). Host arrays only."""
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
