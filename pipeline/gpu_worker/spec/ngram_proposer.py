"""Prompt-lookup drafts on the device, from each request's token history (docs/design.md, "Speculative decoding"; Saxena
2023, "Prompt Lookup Decoding"; vLLM's ``ngram``).

The latest earlier occurrence of the longest matching suffix n-gram gives the next ``K`` tokens (cycling near the end);
unmatched rows repeat their last token. Nothing is read back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def propose_ngram(
    history: torch.Tensor, lengths: torch.Tensor, k: int, n_min: int, n_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft ``k`` tokens per row by prompt lookup over ``history`` (``[R, W]``, row ``r`` valid up to ``lengths[r]``).

    Returns ``(drafts [R, k] int64, num_matched [R] int64)``, ``num_matched`` ``k`` for a found suffix, 0 for filler.
    """
    rows, width = history.shape
    last = lengths - 1
    # history shifted right by t (h[i - t] at column i), -1 before the start: never equal to a token.
    padded = F.pad(history, (n_max, 0), value=-1)
    col = torch.arange(width, device=history.device)
    alive = col[None, :] < last[:, None]  # an occurrence must end before the last token: something follows it
    run = torch.zeros((rows, width), dtype=torch.int32, device=history.device)
    equal = torch.empty_like(alive)
    for t in range(n_max):
        # t <= last: a suffix cannot be longer than the sequence.
        suffix = history.gather(1, (last - t).clamp(min=0)[:, None]).masked_fill_((t > last)[:, None], -1)
        torch.eq(padded[:, n_max - t : n_max - t + width], suffix, out=equal)
        run += alive.logical_and_(equal)
    # Longest run first, then the latest occurrence.
    score = (run * (width + 1) + col[None, :]).masked_fill_(run < n_min, -1).amax(1)
    matched = score >= 0
    end = torch.where(matched, score % (width + 1), last - 1)
    period = (last - end).clamp(min=1)
    ahead = end[:, None] + 1 + torch.arange(k, device=history.device)[None, :] % period[:, None]
    drafts = history.gather(1, ahead.clamp(max=width - 1)).long()
    filler = history.gather(1, last[:, None]).long().expand(rows, k)
    return torch.where(matched[:, None], drafts, filler), matched.long() * k
