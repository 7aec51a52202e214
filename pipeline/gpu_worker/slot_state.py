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

A step's updates are decided on the host first (:meth:`SlotState.stage`,
which stages their arrays in the step's
:class:`~pipeline.gpu_worker.device.UploadBatch`) and written on the device
after the step's one upload (:meth:`SlotState.write`). The parameters of a
slot are one row of a float32 table and one row of an int64 table, so a
step's new rows cost two row writes, whatever they ask for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.common.step_protocol import MAX_LOGIT_BIAS, StepInputs
from pipeline.gpu_worker.device import DeviceOps, Staged, UploadBatch
from pipeline.gpu_worker.penalties import PenaltyState

# Written into a token-id cache entry once a placeholder consumed it; reading
# it again means a placeholder resolved to a stale token.
POISON_TOKEN_ID = -7

# Columns of SlotState.float_params (float32) and SlotState.int_params (int64).
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(6)
TOP_K, SEED = range(2)
# A slot's float parameters before any request used it: greedy, every filter and penalty off.
_FLOAT_DEFAULTS = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)


@dataclass
class SlotUpdate:
    """One step's writes to the slot state, staged for the step's upload (None: nothing of that kind).

    ``block_index``/``block_ids`` ``[B]`` int64: flat block-table index and
    block id of each new entry. ``slots [K]`` int64, ``floats [K, 6]``
    float32, ``ints [K, 2]`` int64: the new rows' parameter rows.
    ``bias_ids``/``bias_values [K, MAX_LOGIT_BIAS]``: their logit_bias
    entries (some new row has one). ``fresh [F]`` int64: penalized new slots,
    whose counts restart at zero.
    """

    block_index: Staged | None = None
    block_ids: Staged | None = None
    slots: Staged | None = None
    floats: Staged | None = None
    ints: Staged | None = None
    bias_ids: Staged | None = None
    bias_values: Staged | None = None
    fresh: Staged | None = None


@dataclass
class InputCounts:
    """Which of a step's input tokens the penalties count, staged (see :meth:`SlotState.count_inputs`).

    ``out_flat``/``out_slot``: step-token index and slot of each output token
    of a penalized slot; ``in_flat``/``in_slot``: the same for prompt tokens.
    """

    out_flat: Staged
    out_slot: Staged
    in_flat: Staged
    in_slot: Staged
    any_output: bool
    any_prompt: bool


class SlotState:
    """Token-id cache, block table and sampling parameters of ``num_slots`` slots.

    Device tensors (on ``ops.device``): ``token_cache [slots]`` int64 (starts
    at :data:`POISON_TOKEN_ID`), ``block_table [slots, max_blocks_per_seq]``
    int64, ``float_params [slots, 6]`` float32 (columns :data:`TEMPERATURE`,
    :data:`TOP_P`, :data:`MIN_P`, :data:`PRESENCE`, :data:`FREQUENCY`,
    :data:`REPETITION`) and ``int_params [slots, 2]`` int64 (:data:`TOP_K`,
    :data:`SEED`); ``temperature``, ``top_p``, ``min_p``, ``top_k`` and
    ``seed`` are ``[slots]`` column views of them. Host mirrors (numpy):
    ``host_temperature``, ``host_top_p``, ``host_top_k``, ``host_min_p``;
    host only: ``host_logprobs [slots]`` int64, alternatives wanted per
    sampled token, -1 for no log-probabilities (the worker computes all
    ``MAX_LOGPROBS``; io_proc keeps what was asked).

    Penalties and biases: ``penalty`` (a
    :class:`~pipeline.gpu_worker.penalties.PenaltyState`: counts, prompt
    mask, the three penalties as column views of ``float_params``,
    logit_bias entries) on the device when ``vocab_size`` is given (the
    simulated device ignores them); host only: ``host_penalized`` (a
    presence, frequency or repetition penalty is on), ``host_num_bias``,
    ``host_min_tokens``, ``host_prompt_len`` and ``host_stop_ids`` (what
    ``min_tokens`` masks), per slot.

    ``any_hot``, ``any_logprobs``, ``any_penalized`` and ``any_penalty_work``
    say whether some slot samples with temperature, wants log-probabilities,
    has a penalty, or has a penalty, bias or ``min_tokens``: when none does,
    a step skips that planning altogether. A slot keeps its last request's
    parameters until a new one arrives, so they may stay True a while after
    the last such request finished (the per-row planning then finds no row).
    """

    def __init__(self, num_slots: int, max_blocks_per_seq: int, ops: DeviceOps, vocab_size: int | None = None):
        self.ops = ops
        device = ops.device
        self.token_cache = torch.full((num_slots,), POISON_TOKEN_ID, dtype=torch.int64, device=device)
        self.block_table = torch.zeros((num_slots, max_blocks_per_seq), dtype=torch.int64, device=device)
        self.float_params = torch.zeros((num_slots, len(_FLOAT_DEFAULTS)), dtype=torch.float32, device=device)
        for col, value in enumerate(_FLOAT_DEFAULTS):
            self.float_params[:, col].fill_(value)
        self.int_params = torch.zeros((num_slots, 2), dtype=torch.int64, device=device)
        self.temperature, self.top_p, self.min_p = (self.float_params[:, c] for c in (TEMPERATURE, TOP_P, MIN_P))
        self.top_k, self.seed = self.int_params[:, TOP_K], self.int_params[:, SEED]
        self.host_temperature = np.zeros(num_slots, dtype=np.float32)
        self.host_top_p = np.ones(num_slots, dtype=np.float32)
        self.host_top_k = np.zeros(num_slots, dtype=np.int64)
        self.host_logprobs = np.full(num_slots, -1, dtype=np.int64)
        self.host_min_p = np.zeros(num_slots, dtype=np.float32)
        self.penalty = (
            None
            if vocab_size is None
            else PenaltyState(
                # int32 counts are exact for any sequence length; a dense row per slot
                # makes each step's update one scatter (docs/design.md, "Penalties and biases").
                counts=torch.zeros((num_slots, vocab_size), dtype=torch.int32, device=device),
                in_prompt=torch.zeros((num_slots, vocab_size), dtype=torch.bool, device=device),
                presence=self.float_params[:, PRESENCE],
                frequency=self.float_params[:, FREQUENCY],
                repetition=self.float_params[:, REPETITION],
                bias_ids=torch.zeros((num_slots, MAX_LOGIT_BIAS), dtype=torch.int64, device=device),
                bias_values=torch.zeros((num_slots, MAX_LOGIT_BIAS), dtype=torch.float32, device=device),
            )
        )
        self.host_penalized = np.zeros(num_slots, dtype=bool)
        self.host_num_bias = np.zeros(num_slots, dtype=np.int64)
        self.host_min_tokens = np.zeros(num_slots, dtype=np.int64)
        self.host_prompt_len = np.zeros(num_slots, dtype=np.int64)
        self.host_stop_ids: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * num_slots
        self.any_hot = self.any_logprobs = self.any_penalized = self.any_penalty_work = False

    def apply(self, x: StepInputs) -> None:
        """Enqueue step ``x``'s block-table entries and its new rows' parameters (:meth:`stage`, one upload,
        :meth:`write`)."""
        batch = UploadBatch()
        update = self.stage(x, batch)
        batch.upload(self.ops)
        self.write(update)

    def stage(self, x: StepInputs, batch: UploadBatch) -> SlotUpdate:
        """Decide step ``x``'s updates on the host: the host mirrors change now, the arrays go into ``batch``."""
        u = SlotUpdate()
        if x.new_blocks.shape[1]:
            slot, index, block = x.new_blocks
            u.block_index = batch.add(slot * self.block_table.shape[1] + index)
            u.block_ids = batch.add(block)
        if not len(x.new_rows):
            return u
        slots = x.slot[x.new_rows]
        floats = np.empty((len(slots), len(_FLOAT_DEFAULTS)), dtype=np.float32)
        for col, values in (
            (TEMPERATURE, x.temperature),
            (TOP_P, x.top_p),
            (MIN_P, x.min_p),
            (PRESENCE, x.presence_penalty),
            (FREQUENCY, x.frequency_penalty),
            (REPETITION, x.repetition_penalty),
        ):
            floats[:, col] = values
        ints = np.empty((len(slots), 2), dtype=np.int64)
        ints[:, TOP_K], ints[:, SEED] = x.top_k, x.seed
        u.slots, u.floats, u.ints = batch.add(slots), batch.add(floats, np.float32), batch.add(ints)
        self.host_temperature[slots], self.host_top_p[slots] = x.temperature, x.top_p
        self.host_top_k[slots], self.host_min_p[slots] = x.top_k, x.min_p
        self.host_logprobs[slots] = x.logprobs
        # With no stop ids to mask (ignore_eos), min_tokens changes nothing: 0 keeps planning off for it.
        self.host_min_tokens[slots] = np.where([len(i) > 0 for i in x.stop_ids], x.min_tokens, 0)
        self.host_prompt_len[slots] = x.prompt_len
        for s, ids in zip(slots, x.stop_ids, strict=True):
            self.host_stop_ids[s] = ids
        if self.penalty is not None:
            penalized = (x.presence_penalty != 0) | (x.frequency_penalty != 0) | (x.repetition_penalty != 1)
            self.host_penalized[slots], self.host_num_bias[slots] = penalized, x.num_logit_bias
            if x.num_logit_bias.any():
                # Entries past a row's count become (token 0, +0): adding them changes nothing.
                unused = np.arange(MAX_LOGIT_BIAS)[None, :] >= x.num_logit_bias[:, None]
                u.bias_ids = batch.add(np.where(unused, 0, x.logit_bias_ids))
                u.bias_values = batch.add(np.where(unused, 0, x.logit_bias_values), np.float32)
            if penalized.any():
                u.fresh = batch.add(slots[penalized])
        self.any_hot = bool((self.host_temperature > 0).any())
        self.any_logprobs = bool((self.host_logprobs >= 0).any())
        self.any_penalized = bool(self.host_penalized.any())
        self.any_penalty_work = self.any_penalized or bool(self.host_num_bias.any() or self.host_min_tokens.any())
        return u

    def write(self, u: SlotUpdate) -> None:
        """Enqueue the device writes of ``u`` (staged by :meth:`stage`; its batch uploaded)."""
        if u.block_index is not None:
            self.block_table.view(-1).index_copy_(0, u.block_index.dev, u.block_ids.dev)
        if u.slots is None:
            return
        self.float_params.index_copy_(0, u.slots.dev, u.floats.dev)
        self.int_params.index_copy_(0, u.slots.dev, u.ints.dev)
        st = self.penalty
        if u.bias_ids is not None:
            st.bias_ids.index_copy_(0, u.slots.dev, u.bias_ids.dev)
            st.bias_values.index_copy_(0, u.slots.dev, u.bias_values.dev)
        if u.fresh is not None:
            st.counts.index_fill_(0, u.fresh.dev, 0)
            st.in_prompt.index_fill_(0, u.fresh.dev, False)

    def stage_counts(self, x: StepInputs, batch: UploadBatch) -> InputCounts | None:
        """Stage which of step ``x``'s input tokens :meth:`count_inputs` counts; None when no row is penalized.

        Call after :meth:`stage` of the same step (it reads the updated mirrors).
        """
        if self.penalty is None or not self.any_penalized:
            return None
        rows = np.flatnonzero(self.host_penalized[x.slot])
        if not len(rows):
            return None
        q = x.query_lens[rows]
        row_of = np.repeat(rows, q)
        j = np.arange(int(q.sum())) - np.repeat(np.cumsum(q) - q, q)  # 0..q-1 within each row
        flat = (np.cumsum(x.query_lens) - x.query_lens)[row_of] + j
        slot = x.slot[row_of]
        is_output = x.start_pos[row_of] + j >= self.host_prompt_len[slot]
        return InputCounts(
            batch.add(flat[is_output]),
            batch.add(slot[is_output]),
            batch.add(flat[~is_output]),
            batch.add(slot[~is_output]),
            bool(is_output.any()),
            not bool(is_output.all()),
        )

    def count_inputs(self, counts: InputCounts | None, input_ids: torch.Tensor) -> None:
        """Count a step's input tokens of penalized slots, on the device, before the step samples.

        A token at a position below its slot's ``prompt_len`` marks the
        prompt mask; any other is an output token (a decode input, or an
        output re-prefilled after a preemption) and adds one to its count.
        Every output token but the last is some step's input, and the last
        is never penalized against, so the counts are exact without
        reading the sampled tokens back.

        Args:
            counts: from :meth:`stage_counts` (its batch uploaded); None counts nothing.
            input_ids: ``[T]`` int64 on the device, placeholders resolved.
        """
        if counts is None:
            return
        st = self.penalty
        if counts.any_output:
            st.counts.index_put_(
                (counts.out_slot.dev, input_ids.index_select(0, counts.out_flat.dev)),
                st.counts.new_ones(()),
                accumulate=True,
            )
        if counts.any_prompt:
            st.in_prompt.index_put_(
                (counts.in_slot.dev, input_ids.index_select(0, counts.in_flat.dev)), st.in_prompt.new_ones(())
            )
