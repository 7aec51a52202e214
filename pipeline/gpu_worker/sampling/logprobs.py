"""Log-probabilities of chosen tokens, computed on the device in the step that produces them.

They are the raw model's log-softmax, before temperature, penalties and top-k/top-p (as vLLM returns by default), so a
token's log-probability does not depend on how it was sampled. Prompt log-probabilities (``echo`` with ``logprobs``)
come from the prefill chunks: position ``j`` of a prompt predicts the prompt token at ``j+1``; chunking changes which
step computes it, not its value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.common.step_output import MAX_LOGPROBS
from pipeline.common.step_protocol import StepInputs

# log_softmax of finite logits is finite, but a -inf logit (a masked token)
# would give -inf, which JSON cannot carry: clamp to the float32 range.
_FLOOR = float(np.finfo(np.float32).min)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's log-probability of its token, and its ``MAX_LOGPROBS`` most likely tokens.

    Args:
        logits: ``[N, V]`` raw logits (any float dtype; computed in float32).
        token_ids: ``[N]`` int64, the chosen token of each row, on the same device.

    Returns:
        ``(logprob [N] float32, top_ids [N, MAX_LOGPROBS] int32, top_logprobs
        [N, MAX_LOGPROBS] float32)``, top entries in descending order, all finite.
    """
    lsm = torch.log_softmax(logits.float(), dim=-1).clamp_(min=_FLOOR)
    lp = lsm.gather(1, token_ids[:, None]).squeeze(1)
    top_lp, top_ids = lsm.topk(min(MAX_LOGPROBS, lsm.shape[-1]), dim=-1)
    return lp, top_ids.to(torch.int32), top_lp


@dataclass
class PromptLogprobPlan:
    """Which positions of a step predict a prompt token whose log-probability is wanted (host numpy).

    ``flat[e]`` indexes the step's tokens (request-major), ``next_token[e]`` is the prompt token it predicts, at
    position ``pos[e]`` of request ``req_num[e]``.
    """

    flat: np.ndarray  # [P] int64
    next_token: np.ndarray  # [P] int64
    req_num: np.ndarray  # [P] int64
    pos: np.ndarray  # [P] int64

    @classmethod
    def of(cls, x: StepInputs) -> PromptLogprobPlan | None:
        """The plan for step ``x``, or None when no row wants prompt log-probabilities."""
        rows = np.flatnonzero(x.num_prompt_logprobs)
        if not len(rows):
            return None
        offsets = np.cumsum(x.num_scheduled_tokens) - x.num_scheduled_tokens
        m = x.num_prompt_logprobs[rows]
        row_of = np.repeat(rows, m)
        j = np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)  # 0..m-1 within each row
        flat = offsets[row_of] + j
        inside = j + 1 < x.num_scheduled_tokens[row_of]
        next_token = np.where(
            inside, x.token_ids[np.minimum(flat + 1, len(x.token_ids) - 1)], x.next_prompt_token[row_of]
        )
        return cls(flat, next_token, x.req_num[row_of], x.start_pos[row_of] + j + 1)
