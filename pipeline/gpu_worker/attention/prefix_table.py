"""Masks of the form "the first ``n`` of ``width`` keys", read as rows of a cached table (docs/design.md, "Attention
metadata")."""

from __future__ import annotations

import torch

# Widest key range the prefix table serves ([w + 1, w] bool: 16 MiB at 4,096); wider masks are computed.
_PREFIX_TABLE_MAX = 4096


class PrefixTable:
    """Masks "the first ``n`` of ``width`` keys" as row gathers from a cached ``table[n, k] = k < n``, cheaper on CPU
    than a broadcast comparison; grows by doubling up to ``_PREFIX_TABLE_MAX`` keys."""

    def __init__(self) -> None:
        self.table: torch.Tensor | None = None

    def rows(self, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """``[R, width]`` bool on ``lengths``' device: row ``r`` is True at ``k < lengths[r]`` (``lengths``: ``[R]``
        int64)."""
        device = lengths.device
        if width > _PREFIX_TABLE_MAX:
            return torch.arange(width, device=device)[None, :] < lengths[:, None]
        t = self.table
        if t is None or t.shape[1] < width or t.device != device:
            w = min(_PREFIX_TABLE_MAX, max(256, 1 << (width - 1).bit_length()))
            # A normal tensor even when first made in inference mode: build_from_rows may run outside it.
            with torch.inference_mode(False):
                self.table = t = torch.arange(w, device=device)[None, :] < torch.arange(w + 1, device=device)[:, None]
        return t[:, :width].index_select(0, lengths)
