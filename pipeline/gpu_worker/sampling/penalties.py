"""Penalties and biases on the logits, per request, on the device (docs/design.md, "Penalties and biases").

In vLLM's order: ``logit_bias``; ``min_tokens`` (stop ids -inf); repetition (Keskar et al. 2019, "CTRL", eq. 2: ``l /
r`` if ``l > 0`` else ``l * r``); frequency and presence (OpenAI API reference: ``mu[j] - c[j] * alpha_frequency -
float(c[j] > 0) * alpha_presence``). Works on a copy: log-probabilities stay raw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.gpu_worker.device import Staged, UploadBatch


@dataclass
class PenaltyInputs:
    """What one step's penalties need, on the device (int64 index tensors).

    ``rows``/``req_indices``: ``[Q]``; ``min_tokens_rows``/``min_tokens_ids``: ``[M]`` tokens set to -inf;
    ``draft_rows``/``draft_tokens``: ``[E]`` drafts counted once more; None for none.
    """

    rows: torch.Tensor
    req_indices: torch.Tensor
    use_bias: bool
    use_penalties: bool
    min_tokens_rows: torch.Tensor | None = None
    min_tokens_ids: torch.Tensor | None = None
    draft_rows: torch.Tensor | None = None
    draft_tokens: torch.Tensor | None = None


@dataclass
class PenaltyPlan:
    """The host half of ``PenaltyInputs`` (numpy int64) from ``plan_penalties``; ``draft_flat`` is each counted draft's
    step-token index."""

    rows: np.ndarray
    req_indices: np.ndarray
    use_bias: bool
    use_penalties: bool
    min_tokens_rows: np.ndarray | None = None
    min_tokens_ids: np.ndarray | None = None
    draft_rows: np.ndarray | None = None
    draft_flat: np.ndarray | None = None
    _staged: list[Staged] = field(default_factory=list)

    def stage(self, batch: UploadBatch) -> None:
        """Add the plan's arrays to ``batch``."""
        arrays = [self.rows, self.req_indices]
        if self.min_tokens_rows is not None:
            arrays += [self.min_tokens_rows, self.min_tokens_ids]
        if self.draft_rows is not None:
            arrays += [self.draft_rows, self.draft_flat]
        self._staged = [batch.add(a) for a in arrays]

    def on_device(self, input_ids: torch.Tensor | None = None) -> PenaltyInputs:
        """The ``PenaltyInputs`` of the staged arrays; ``input_ids`` (``[T]`` int64, resolved) needed with
        ``draft_rows``."""
        dev = iter(s.dev for s in self._staged)
        out = PenaltyInputs(next(dev), next(dev), self.use_bias, self.use_penalties)
        if self.min_tokens_rows is not None:
            out.min_tokens_rows, out.min_tokens_ids = next(dev), next(dev)
        if self.draft_rows is not None:
            out.draft_rows, out.draft_tokens = next(dev), input_ids.index_select(0, next(dev))
        return out


def plan_penalties(
    req_indices: np.ndarray,
    output_index: np.ndarray,
    penalized: np.ndarray,
    num_bias: np.ndarray,
    min_tokens: np.ndarray,
    stop_ids: Sequence[np.ndarray],
    drafts_before: np.ndarray | None = None,
    first_draft: np.ndarray | None = None,
) -> PenaltyPlan | None:
    """Decide on the host which sampled rows get what; None when none.

    ``[S]`` arrays: ``output_index`` counts output tokens before the one sampled; ``drafts_before``/``first_draft``
    (None without verification) count preceding drafts as output (docs/design.md, "Speculative decoding").
    """
    masks_stop = output_index < min_tokens
    rows = np.flatnonzero(penalized | (num_bias > 0) | masks_stop)
    if not len(rows):
        return None
    plan = PenaltyPlan(
        rows=rows,
        req_indices=req_indices[rows],
        use_bias=bool((num_bias[rows] > 0).any()),
        use_penalties=bool(penalized[rows].any()),
    )
    stopped = np.flatnonzero(masks_stop[rows])
    if len(stopped):
        ids = [stop_ids[req_indices[rows[q]]] for q in stopped]
        plan.min_tokens_rows, plan.min_tokens_ids = np.repeat(stopped, [len(i) for i in ids]), np.concatenate(ids)
    if drafts_before is not None:
        n = np.where(penalized[rows], drafts_before[rows], 0)
        if n.any():
            q = np.repeat(np.arange(len(rows)), n)
            i = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # 0..n-1 within each row
            plan.draft_rows, plan.draft_flat = q, first_draft[rows][q] + i
    return plan


@dataclass
class PenaltyState:
    """The per-request device tensors the penalties read (owned by ``InputBatch``).

    ``counts``: ``[max_num_reqs, V]`` int32 output occurrences; ``in_prompt``: same shape, bool; ``bias_ids`` int64 and
    ``bias_values`` float32: ``[max_num_reqs, MAX_LOGIT_BIAS]`` (unused: token 0, value 0).
    """

    counts: torch.Tensor
    in_prompt: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor


def apply_penalties(logits: torch.Tensor, inputs: PenaltyInputs | None, state: PenaltyState) -> torch.Tensor:
    """The ``[S, V]`` float32 logits the sampler should see: ``logits`` itself when no row is penalized, else a
    penalized copy; never waits for the device."""
    if inputs is None:
        return logits
    x = logits.index_select(0, inputs.rows)
    if inputs.use_bias:
        # Unused entries add 0 to token 0; OpenAI's keys are distinct, so no entry adds twice.
        x.scatter_add_(
            1, state.bias_ids.index_select(0, inputs.req_indices), state.bias_values.index_select(0, inputs.req_indices)
        )
    if inputs.min_tokens_rows is not None:
        x.index_put_((inputs.min_tokens_rows, inputs.min_tokens_ids), x.new_full((), float("-inf")))
    if inputs.use_penalties:
        counts = state.counts.index_select(0, inputs.req_indices)
        if inputs.draft_rows is not None:
            counts.index_put_((inputs.draft_rows, inputs.draft_tokens), counts.new_ones(()), accumulate=True)
        in_output = counts > 0
        seen = in_output | state.in_prompt.index_select(0, inputs.req_indices)
        r = state.repetition.index_select(0, inputs.req_indices)[:, None]
        # -inf (a masked stop token) stays -inf through all three: r > 0.
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x -= state.frequency.index_select(0, inputs.req_indices)[:, None] * counts
        x -= state.presence.index_select(0, inputs.req_indices)[:, None] * in_output
        # l / r overflows float32 for a tiny r: keep the row finite or -inf, so greedy and the sampler stay defined.
        torch.nan_to_num_(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
    return logits.index_copy(0, inputs.rows, x)
