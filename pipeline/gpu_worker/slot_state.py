"""Per-slot state the worker keeps on the device, updated in stream order.

A request keeps one slot while it runs (docs/design.md, "The step
protocol"). For each slot the device holds the last sampled token (the
token-id cache), the block-table row, the sampling parameters, and for
requests with penalties their token counts (docs/design.md, "Penalties and
biases"). Updates
come from the descriptor: new block-table entries every step, parameters
only on a request's first step in its slot. They are enqueued
on the compute stream before the step that reads them, so a step already
queued never sees a later step's update, and no update waits for the device.

The sampling parameters are also mirrored on the host. The host copy decides
how to sample (which rows are greedy, how many top-k candidates, whether
top-p runs); the device copy is what the kernels read. Neither is ever read
back from the device.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.common.step_protocol import MAX_LOGIT_BIAS, StepInputs
from pipeline.gpu_worker.device import DeviceOps
from pipeline.gpu_worker.penalties import PenaltyState

# Written into a token-id cache entry once a placeholder consumed it; reading
# it again means a placeholder resolved to a stale token.
POISON_TOKEN_ID = -7


class SlotState:
    """Token-id cache, block table and sampling parameters of ``num_slots`` slots.

    Device tensors (on ``ops.device``): ``token_cache [slots]`` int64 (starts
    at :data:`POISON_TOKEN_ID`), ``block_table [slots, max_blocks_per_seq]``
    int64, ``temperature``/``top_p [slots]`` float32, ``top_k``/``seed
    [slots]`` int64. Host mirrors (numpy): ``host_temperature``,
    ``host_top_p``, ``host_top_k``; host only: ``host_logprobs [slots]``
    int64, alternatives wanted per sampled token, -1 for no log-probabilities
    (the worker computes all ``MAX_LOGPROBS``; io_proc keeps what was asked).

    Penalties and biases: ``min_p [slots]`` float32 on the device and
    mirrored on the host; ``penalty`` (a
    :class:`~pipeline.gpu_worker.penalties.PenaltyState`: counts, prompt
    mask, the three penalties, logit_bias entries) on the device when
    ``vocab_size`` is given (the simulated device ignores them); host only:
    ``host_penalized`` (a presence, frequency or repetition penalty is on),
    ``host_num_bias``, ``host_min_tokens``, ``host_prompt_len`` and
    ``host_stop_ids`` (what ``min_tokens`` masks), per slot.
    """

    def __init__(self, num_slots: int, max_blocks_per_seq: int, ops: DeviceOps, vocab_size: int | None = None):
        self.ops = ops
        device = ops.device
        self.token_cache = torch.full((num_slots,), POISON_TOKEN_ID, dtype=torch.int64, device=device)
        self.block_table = torch.zeros((num_slots, max_blocks_per_seq), dtype=torch.int64, device=device)
        self.temperature = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.seed = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.host_temperature = np.zeros(num_slots, dtype=np.float32)
        self.host_top_p = np.ones(num_slots, dtype=np.float32)
        self.host_top_k = np.zeros(num_slots, dtype=np.int64)
        self.host_logprobs = np.full(num_slots, -1, dtype=np.int64)
        self.min_p = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.host_min_p = np.zeros(num_slots, dtype=np.float32)
        self.penalty = None if vocab_size is None else PenaltyState(
            # int32 counts are exact for any sequence length; a dense row per slot
            # makes each step's update one scatter (docs/design.md, "Penalties and biases").
            counts=torch.zeros((num_slots, vocab_size), dtype=torch.int32, device=device),
            in_prompt=torch.zeros((num_slots, vocab_size), dtype=torch.bool, device=device),
            presence=torch.zeros(num_slots, dtype=torch.float32, device=device),
            frequency=torch.zeros(num_slots, dtype=torch.float32, device=device),
            repetition=torch.ones(num_slots, dtype=torch.float32, device=device),
            bias_ids=torch.zeros((num_slots, MAX_LOGIT_BIAS), dtype=torch.int64, device=device),
            bias_values=torch.zeros((num_slots, MAX_LOGIT_BIAS), dtype=torch.float32, device=device))
        self.host_penalized = np.zeros(num_slots, dtype=bool)
        self.host_num_bias = np.zeros(num_slots, dtype=np.int64)
        self.host_min_tokens = np.zeros(num_slots, dtype=np.int64)
        self.host_prompt_len = np.zeros(num_slots, dtype=np.int64)
        self.host_stop_ids: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * num_slots

    def apply(self, x: StepInputs) -> None:
        """Enqueue step ``x``'s block-table entries and its new rows' sampling parameters."""
        if x.new_blocks.shape[1]:
            slot, index, block = x.new_blocks
            width = self.block_table.shape[1]
            flat_index, block_ids = self.ops.upload([slot * width + index, block])
            self.block_table.view(-1).index_copy_(0, flat_index, block_ids)
        if len(x.new_rows):
            slots = x.slot[x.new_rows]
            slots_d, top_k_d, seed_d = self.ops.upload([slots, x.top_k, x.seed])
            temperature_d, top_p_d = self.ops.upload([x.temperature, x.top_p], np.float32)
            self.temperature.index_copy_(0, slots_d, temperature_d)
            self.top_p.index_copy_(0, slots_d, top_p_d)
            self.top_k.index_copy_(0, slots_d, top_k_d)
            self.seed.index_copy_(0, slots_d, seed_d)
            self.host_temperature[slots], self.host_top_p[slots] = x.temperature, x.top_p
            self.host_top_k[slots] = x.top_k
            self.host_logprobs[slots] = x.logprobs
            self._apply_penalty_params(x, slots, slots_d)

    def _apply_penalty_params(self, x: StepInputs, slots: np.ndarray, slots_d: torch.Tensor) -> None:
        """The new rows' min_p, penalties and logit_bias; a penalized slot's counts start at zero."""
        (min_p_d,) = self.ops.upload([x.min_p], np.float32)
        self.min_p.index_copy_(0, slots_d, min_p_d)
        self.host_min_p[slots] = x.min_p
        # With no stop ids to mask (ignore_eos), min_tokens changes nothing: 0 keeps planning off for it.
        self.host_min_tokens[slots] = np.where([len(i) > 0 for i in x.stop_ids], x.min_tokens, 0)
        self.host_prompt_len[slots] = x.prompt_len
        for s, ids in zip(slots, x.stop_ids, strict=True):
            self.host_stop_ids[s] = ids
        if self.penalty is None:
            return
        st = self.penalty
        penalized = (x.presence_penalty != 0) | (x.frequency_penalty != 0) | (x.repetition_penalty != 1)
        self.host_penalized[slots], self.host_num_bias[slots] = penalized, x.num_logit_bias
        presence_d, frequency_d, repetition_d = self.ops.upload(
            [x.presence_penalty, x.frequency_penalty, x.repetition_penalty], np.float32)
        st.presence.index_copy_(0, slots_d, presence_d)
        st.frequency.index_copy_(0, slots_d, frequency_d)
        st.repetition.index_copy_(0, slots_d, repetition_d)
        if x.num_logit_bias.any():
            # Entries past a row's count become (token 0, +0): adding them changes nothing.
            unused = np.arange(MAX_LOGIT_BIAS)[None, :] >= x.num_logit_bias[:, None]
            (ids_d,) = self.ops.upload([np.where(unused, 0, x.logit_bias_ids)])
            (values_d,) = self.ops.upload([np.where(unused, 0, x.logit_bias_values)], np.float32)
            st.bias_ids.index_copy_(0, slots_d, ids_d)
            st.bias_values.index_copy_(0, slots_d, values_d)
        if penalized.any():
            (fresh_d,) = self.ops.upload([slots[penalized]])
            st.counts.index_fill_(0, fresh_d, 0)
            st.in_prompt.index_fill_(0, fresh_d, False)

    def count_inputs(self, x: StepInputs, input_ids: torch.Tensor) -> None:
        """Count step ``x``'s input tokens of penalized slots, on the device, before the step samples.

        A token at a position below its slot's ``prompt_len`` marks the
        prompt mask; any other is an output token (a decode input, or an
        output re-prefilled after a preemption) and adds one to its count.
        Every output token but the last is some step's input, and the last
        is never penalized against, so the counts are exact without
        reading the sampled tokens back.

        Args:
            x: the step (host arrays).
            input_ids: ``[T]`` int64 on the device, placeholders resolved.
        """
        if self.penalty is None:
            return
        rows = np.flatnonzero(self.host_penalized[x.slot])
        if not len(rows):
            return
        q = x.query_lens[rows]
        row_of = np.repeat(rows, q)
        j = np.arange(int(q.sum())) - np.repeat(np.cumsum(q) - q, q)  # 0..q-1 within each row
        flat = (np.cumsum(x.query_lens) - x.query_lens)[row_of] + j
        slot = x.slot[row_of]
        is_output = x.start_pos[row_of] + j >= self.host_prompt_len[slot]
        out_flat, out_slot, in_flat, in_slot = self.ops.upload(
            [flat[is_output], slot[is_output], flat[~is_output], slot[~is_output]])
        st = self.penalty
        if is_output.any():
            st.counts.index_put_((out_slot, input_ids.index_select(0, out_flat)),
                                 st.counts.new_ones(()), accumulate=True)
        if not is_output.all():
            st.in_prompt.index_put_((in_slot, input_ids.index_select(0, in_flat)), st.in_prompt.new_ones(()))
