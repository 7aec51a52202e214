"""Masks of the form "the first ``n`` of ``width`` keys", read as rows of a cached table (docs/design.md, "Attention
metadata")."""

from __future__ import annotations

import torch

# Widest key range the prefix table serves ([w + 1, w] bool: 16 MiB at 4,096); wider masks are computed.
_PREFIX_TABLE_MAX = 4096


class PrefixTable:
    """Masks of the form "the first ``n`` of ``width`` keys", as a row gather from a cached table.

    ``table[n, k] = k < n``. A broadcast comparison writes an ``[R, W]`` bool mask element by element, which on CPU
    torch costs about 0.5 ns per element (140 us for 1,024 decode rows of 288 keys, more than the rest of the step's
    metadata); gathering ``R`` rows of this table costs 12 us. On a GPU both are one kernel. The table grows by doubling
    as contexts grow (a rebuild costs one comparison of its size), up to ``_PREFIX_TABLE_MAX`` keys; wider masks fall
    back to the comparison.
    """

    def __init__(self) -> None:
        self.table: torch.Tensor | None = None

    def rows(self, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """``[R, width]`` bool on ``lengths``' device: row ``r`` is True at ``k < lengths[r]``.

        Args:
            lengths: ``[R]`` int64 on the device, each in ``[0, width]``.
            width: keys per row.
        """
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
