"""Prompt-lookup drafts on the device, from each request's token history (docs/design.md, "Speculative decoding").

For each row, the longest suffix n-gram of its tokens (``prompt_lookup_min <= n <= prompt_lookup_max``) that also ends
earlier in its prompt plus output, the latest such occurrence, and the ``K`` tokens that followed it there (Saxena 2023,
"Prompt Lookup Decoding"; vLLM's ``ngram`` method). When the occurrence ends fewer than ``K`` tokens before the end, the
tokens after it are the sequence's own last ones and the drafts go round that cycle again (a loop of period ``P``
repeats every ``P`` tokens), so every matched row has ``K`` drafts. A row with no match gets its last token ``K`` times
as filler: verification rejects it unless it happens to be right.

All rows at once, in ``prompt_lookup_max`` passes of elementwise comparisons over ``[R, W]``; the result stays on the
device, so no sampled token is read back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def propose_ngram(
    history: torch.Tensor, lengths: torch.Tensor, k: int, n_min: int, n_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft ``k`` tokens per row by prompt lookup.

    Args:
        history: ``[R, W]`` integer token ids (>= 0); row ``r``'s sequence is ``history[r, : lengths[r]]``, later
            entries are ignored.
        lengths: ``[R]`` int64, each in ``[1, W]``.
        k: drafts per row, >= 1.
        n_min, n_max: the n-gram lengths tried, ``1 <= n_min <= n_max``.

    Returns:
        ``(drafts [R, k] int64, num_matched [R] int64)``: ``num_matched`` is ``k`` for a row whose
        suffix was found (its drafts are the lookup's) and 0 for one whose drafts are filler.
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
