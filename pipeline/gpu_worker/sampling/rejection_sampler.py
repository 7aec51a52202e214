"""Verification of speculative drafts on the device (docs/design.md, "Speculative decoding").

A row verifying ``K`` drafts ``d_1..d_K`` has ``K + 1`` sampled positions: position ``j`` predicts the token after the
row's resolved last token and ``d_1..d_j``. Every position is processed exactly as a one-token step would process it
(penalties counting ``d_1..d_j`` as output, ``logit_bias``, ``min_tokens`` at its own output index, temperature, min-p,
top-k, top-p, noise keyed by (seed, position)), and the row emits its accepted drafts plus one token from the target:
``accepted + 1`` tokens, the last the correction (or, with every draft accepted, the bonus).

**Drafts without probabilities** (prompt lookup; a greedy draft model): the target's own token at each
position is drawn first, with the noise it would use without speculation, and the row accepts the
longest prefix of drafts equal to those tokens. The race picks a draft ``d`` with probability
``p(d)`` and otherwise a token distributed as ``p`` without ``d``, renormalised: standard rejection
sampling with a one-hot ``q`` (accept with probability ``min(1, p(d) / 1)``, resample from
``normalize(max(0, p - q))``). It is also the very token the request draws without speculation, so a
seeded request's output is the same with speculation on and off. Greedy rows compare with the argmax.

**Drafts with probabilities** (a draft model sampling at the request's temperature): Leviathan et
al. 2023, "Fast Inference from Transformers via Speculative Decoding" (arXiv 2211.17192),
Algorithm 1: ``d_j`` is accepted with probability ``min(1, p(d_j) / q(d_j))`` (a uniform keyed by
(seed, position), independent of the draws), and at the first rejection the row emits a draw from
``normalize(max(0, p - q))`` with the target's noise; with all accepted, the bonus is the target's
own draw at position ``K``.

Everything is shaped by host-known sizes; nothing is read back (docs/design.md, "The worker").
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

    Attributes:
        index: ``[R, K + 1]`` int64, the sampled positions (rows of the step's ``[S', V]`` logits) of each verified row,
            in order.
        drafts: ``[R, K]`` int64 draft token ids.
        draft_probs: ``[H, K, V]`` float32, the draft distribution each draft of the ``H`` sampled (temperature > 0)
            verified rows was drawn from; None for drafts without probabilities.
        hot_rows: ``[H]`` int64, which of the ``R`` rows those are (with ``draft_probs``).
        hot_index: ``[H, K + 1]`` int64, their positions' rows among the sampler's temperature rows
            (``SamplingInputs.plan.rows``).
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

    Args:
        x: ``[H, K + 1, V]`` float32 target log-weights per position (filtered, temperature-scaled; -inf dropped).
        draft_probs: ``[H, K, V]`` the distribution each draft was drawn from.
        drafts: ``[H, K]`` int64.
        targets: ``[H, K + 1]`` int64, the target's own draws (its noise); the last is the bonus.
        seeds: ``[H]`` int64 the rows' seeds; positions: ``[H, K + 1]`` int64 each position's.

    Returns:
        ``(tokens [H, K + 1], accepted [H])``: ``tokens[:, :accepted]`` are the accepted drafts and
        ``tokens[:, accepted]`` the residual draw (or the bonus).
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
