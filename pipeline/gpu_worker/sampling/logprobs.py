"""Log-probabilities of chosen tokens, computed on the device: the raw model's log-softmax (as vLLM by default); prompt
position ``j`` predicts token ``j + 1``."""

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
    """Each row's log-probability of its ``token_ids`` (``[N]`` int64) from ``logits`` (``[N, V]``, computed in
    float32).

    Returns ``(logprob [N] float32, top_ids [N, MAX_LOGPROBS] int32, top_logprobs [N, MAX_LOGPROBS] float32)``, top
    entries descending, all finite.
    """
    lsm = torch.log_softmax(logits.float(), dim=-1).clamp_(min=_FLOOR)
    lp = lsm.gather(1, token_ids[:, None]).squeeze(1)
    top_lp, top_ids = lsm.topk(min(MAX_LOGPROBS, lsm.shape[-1]), dim=-1)
    return lp, top_ids.to(torch.int32), top_lp


@dataclass
class PromptLogprobPlan:
    """Which step positions predict a wanted prompt logprob (host numpy): ``flat`` step-token index, ``next_token``,
    ``pos``, ``req_num``."""

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
