"""Verification of speculative drafts on the device (docs/design.md, "Speculative decoding").

Each of a row's ``K + 1`` positions is sampled as a one-token step would be; the row emits its accepted drafts plus a
correction (or bonus). Drafts without probabilities are accepted while equal to the target's own draw (rejection
sampling with one-hot ``q``: seeded output is unchanged by speculation). Drafts with probabilities: Leviathan et al.
2023, "Fast Inference from Transformers via Speculative Decoding" (arXiv 2211.17192), Algorithm 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.gpu_worker.sampling.sampler import race, uniform_noise

# XORed into a request's seed for the acceptance uniforms and for a draft model's own draws, so
# neither shares noise with the target's draw at the same position.
ACCEPT_SALT = 0x5DEECE66D
DRAFT_SALT = 0x2545F4914F6CDD1D


@dataclass
class VerifyInputs:
    """The verified rows of a step, on the device; shapes are host-known.

    ``index``: ``[R, K + 1]`` int64 rows of the ``[S', V]`` logits; ``drafts``: ``[R, K]`` int64; ``draft_probs``: ``[H,
    K, V]`` float32 for the ``H`` temperature rows (None: no probabilities), ``hot_rows [H]`` and ``hot_index [H, K +
    1]`` locate them.
    """

    index: torch.Tensor
    drafts: torch.Tensor
    draft_probs: torch.Tensor | None = None
    hot_rows: torch.Tensor | None = None
    hot_index: torch.Tensor | None = None


def accept_one_hot(targets: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """``[R]`` int64: per row, the longest prefix of ``drafts`` (``[R, K]``) equal to ``targets[:, :K]`` (``targets``:
    ``[R, K + 1]``)."""
    return (targets[:, :-1] == drafts).long().cumprod(1).sum(1)


def rejection_sample(
    x: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    targets: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of drafts drawn from ``draft_probs`` (Leviathan et al. 2023, Algorithm 1).

    ``x``: ``[H, K + 1, V]`` float32 filtered target log-weights; ``targets``: ``[H, K + 1]`` the target's own draws
    (last: the bonus). Returns ``(tokens [H, K + 1], accepted [H])``: accepted drafts then the residual draw or bonus.
    """
    h, k = drafts.shape
    p = torch.softmax(x[:, :k], dim=-1)
    p_d = p.gather(2, drafts[:, :, None]).squeeze(2)
    q_d = draft_probs.gather(2, drafts[:, :, None]).squeeze(2)
    u = uniform_noise((seeds ^ ACCEPT_SALT).repeat_interleave(k), positions[:, :k].reshape(-1), 1).view(h, k)
    # u < p / q, without dividing (q(d) > 0 for a drawn d; q = 0 would accept).
    accepted = (u * q_d < p_d).long().cumprod(1).sum(1)
    residual = (p - draft_probs).clamp_(min=0)
    # p == q leaves no residual mass, and then rejection has probability 0: any row of p will do.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual).log_().view(h * k, -1)
    drawn = race(residual, seeds.repeat_interleave(k), positions[:, :k].reshape(-1)).view(h, k)
    j = torch.arange(k + 1, device=drafts.device)[None, :]
    tokens = torch.where(j < accepted[:, None], torch.cat([drafts, drafts[:, :1]], 1), targets)
    correction = torch.cat([drawn, targets[:, k:]], 1).gather(1, accepted[:, None])
    return tokens.scatter_(1, accepted[:, None], correction), accepted
