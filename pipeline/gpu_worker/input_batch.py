"""Per-request state the worker keeps on the device, by req_index, updated in stream order before the step that reads it
(docs/design.md, "The step protocol"); sampling parameters are mirrored on the host, nothing is read back."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.common.step_protocol import MAX_LOGIT_BIAS, StepInputs
from pipeline.gpu_worker.device import DeviceOps, Staged, UploadBatch
from pipeline.gpu_worker.sampling.penalties import PenaltyState
from pipeline.gpu_worker.sampling.sampler import SamplingPlan, SamplingTensors

# Written into a token-id cache entry once a placeholder consumed it; reading
# it again means a placeholder resolved to a stale token.
POISON_TOKEN_ID = -7

# The sampling parameters a row keeps on the device, by name (StepInputs'
# field names), with their value in a row no request used yet: greedy, every
# filter and penalty off. They are the columns of one float32 and one int64
# table, so a step's new rows cost two row writes whatever they ask for.
FLOAT_PARAMS = {
    "temperature": 0.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
INT_PARAMS = {"top_k": 0, "seed": 0}
FLOAT_COLUMN = {name: i for i, name in enumerate(FLOAT_PARAMS)}
INT_COLUMN = {name: i for i, name in enumerate(INT_PARAMS)}


@dataclass
class RowUpdate:
    """One step's writes to the rows, staged for its upload (None: nothing of that kind).

    ``block_index``/``block_ids`` ``[B]`` int64; new rows' ``req_indices [K]`` int64, ``floats``/``ints [K, n]``
    float32/int64, ``bias_ids``/``bias_values [K, MAX_LOGIT_BIAS]``; ``fresh [F]``: penalized new rows (counts reset).
    """

    block_index: Staged | None = None
    block_ids: Staged | None = None
    req_indices: Staged | None = None
    floats: Staged | None = None
    ints: Staged | None = None
    bias_ids: Staged | None = None
    bias_values: Staged | None = None
    fresh: Staged | None = None


@dataclass
class InputCounts:
    """Which of a step's input tokens the penalties count, staged: step-token index and req_index of output (``out_*``)
    and prompt (``in_*``) tokens."""

    out_flat: Staged
    out_req_index: Staged
    in_flat: Staged
    in_req_index: Staged
    any_output: bool
    any_prompt: bool


class InputBatch:
    """Token-id cache, block table and sampling parameters of ``max_num_reqs`` rows (vLLM's persistent batch).

    Device: ``token_cache [max_num_reqs]`` int64 (starts at ``POISON_TOKEN_ID``), ``block_table [max_num_reqs,
    max_blocks_per_seq]`` int64, ``float_params``/``int_params``, ``penalty`` (when ``vocab_size`` is given). Host
    mirrors ``host_*`` decide the planning; ``any_*`` flags skip it when no row needs it (they may stay True a while).
    """

    def __init__(self, max_num_reqs: int, max_blocks_per_seq: int, ops: DeviceOps, vocab_size: int | None = None):
        self.ops = ops
        device = ops.device
        n = max_num_reqs
        self.token_cache = torch.full((n,), POISON_TOKEN_ID, dtype=torch.int64, device=device)
        self.block_table = torch.zeros((n, max_blocks_per_seq), dtype=torch.int64, device=device)
        self.float_params = torch.empty((n, len(FLOAT_PARAMS)), dtype=torch.float32, device=device)
        self.int_params = torch.empty((n, len(INT_PARAMS)), dtype=torch.int64, device=device)
        self.params = {name: self.float_params[:, i] for name, i in FLOAT_COLUMN.items()}
        self.params |= {name: self.int_params[:, i] for name, i in INT_COLUMN.items()}
        for name, value in (FLOAT_PARAMS | INT_PARAMS).items():
            self.params[name].fill_(value)
        self.host_temperature = np.zeros(n, dtype=np.float32)
        self.host_top_p = np.ones(n, dtype=np.float32)
        self.host_top_k = np.zeros(n, dtype=np.int64)
        self.host_logprobs = np.full(n, -1, dtype=np.int64)
        self.host_min_p = np.zeros(n, dtype=np.float32)
        self.penalty = (
            None
            if vocab_size is None
            else PenaltyState(
                # int32 counts are exact for any sequence length; a dense row per request
                # makes each step's update one scatter (docs/design.md, "Penalties and biases").
                counts=torch.zeros((n, vocab_size), dtype=torch.int32, device=device),
                in_prompt=torch.zeros((n, vocab_size), dtype=torch.bool, device=device),
                presence=self.params["presence_penalty"],
                frequency=self.params["frequency_penalty"],
                repetition=self.params["repetition_penalty"],
                bias_ids=torch.zeros((n, MAX_LOGIT_BIAS), dtype=torch.int64, device=device),
                bias_values=torch.zeros((n, MAX_LOGIT_BIAS), dtype=torch.float32, device=device),
            )
        )
        self.host_penalized = np.zeros(n, dtype=bool)
        self.host_num_bias = np.zeros(n, dtype=np.int64)
        self.host_min_tokens = np.zeros(n, dtype=np.int64)
        self.host_prompt_len = np.zeros(n, dtype=np.int64)
        self.host_stop_ids: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * n
        self.any_hot = self.any_logprobs = self.any_penalized = self.any_penalty_work = False

    def apply(self, x: StepInputs) -> None:
        """Enqueue step ``x``'s block-table entries and its new rows' parameters (``stage``, one upload, ``write``)."""
        batch = UploadBatch()
        update = self.stage(x, batch)
        batch.upload(self.ops)
        self.write(update)

    def stage(self, x: StepInputs, batch: UploadBatch) -> RowUpdate:
        """Decide step ``x``'s updates on the host: the host mirrors change now, the arrays go into ``batch``."""
        u = RowUpdate()
        if len(x.nb_block):
            u.block_index = batch.add(x.nb_req_index * self.block_table.shape[1] + x.nb_index)
            u.block_ids = batch.add(x.nb_block)
        if not len(x.new_rows):
            return u
        req_indices = x.req_index[x.new_rows]
        floats = np.stack([getattr(x, name) for name in FLOAT_PARAMS], axis=1).astype(np.float32, copy=False)
        ints = np.stack([getattr(x, name) for name in INT_PARAMS], axis=1).astype(np.int64, copy=False)
        u.req_indices, u.floats, u.ints = batch.add(req_indices), batch.add(floats, np.float32), batch.add(ints)
        self.host_temperature[req_indices], self.host_top_p[req_indices] = x.temperature, x.top_p
        self.host_top_k[req_indices], self.host_min_p[req_indices] = x.top_k, x.min_p
        self.host_logprobs[req_indices] = x.logprobs
        # With no stop ids to mask (ignore_eos), min_tokens changes nothing: 0 keeps planning off for it.
        self.host_min_tokens[req_indices] = np.where(x.num_stop_ids > 0, x.min_tokens, 0)
        self.host_prompt_len[req_indices] = x.prompt_len
        for i, (s, n) in enumerate(zip(req_indices.tolist(), x.num_stop_ids.tolist())):
            self.host_stop_ids[s] = x.stop_ids[i, :n]
        if self.penalty is not None:
            penalized = (x.presence_penalty != 0) | (x.frequency_penalty != 0) | (x.repetition_penalty != 1)
            # A row whose last request had biases keeps them on the device until they are overwritten.
            stale_bias = bool(self.host_num_bias[req_indices].any())
            self.host_penalized[req_indices], self.host_num_bias[req_indices] = penalized, x.num_logit_bias
            if x.num_logit_bias.any() or stale_bias:
                # Entries past a row's count become (token 0, +0): adding them changes nothing.
                unused = np.arange(MAX_LOGIT_BIAS)[None, :] >= x.num_logit_bias[:, None]
                u.bias_ids = batch.add(np.where(unused, 0, x.logit_bias_ids))
                u.bias_values = batch.add(np.where(unused, 0, x.logit_bias_values), np.float32)
            if penalized.any():
                u.fresh = batch.add(req_indices[penalized])
        self.any_hot = bool((self.host_temperature > 0).any())
        self.any_logprobs = bool((self.host_logprobs >= 0).any())
        self.any_penalized = bool(self.host_penalized.any())
        self.any_penalty_work = self.any_penalized or bool(self.host_num_bias.any() or self.host_min_tokens.any())
        return u

    def sampling_tensors(
        self, rows: torch.Tensor, req: np.ndarray, req_dev: torch.Tensor, vocab: int, host_reads_ok: bool
    ) -> SamplingTensors:
        """The parameters of the sampled rows ``rows`` (``[R]`` on the device), at req_indices ``req`` (``[R]`` host)
        and ``req_dev`` (the same, staged): one gather per table, the columns views of it."""
        f, i = self.float_params.index_select(0, req_dev), self.int_params.index_select(0, req_dev)
        plan = SamplingPlan.build(
            rows, self.host_top_k[req], self.host_top_p[req], vocab, host_reads_ok, self.host_min_p[req]
        )
        fc, ic = FLOAT_COLUMN, INT_COLUMN
        return SamplingTensors(
            plan, f[:, fc["temperature"]], f[:, fc["top_p"]], i[:, ic["top_k"]], f[:, fc["min_p"]], i[:, ic["seed"]]
        )

    def write(self, u: RowUpdate) -> None:
        """Enqueue the device writes of ``u`` (staged by ``stage``; its batch uploaded)."""
        if u.block_index is not None:
            self.block_table.view(-1).index_copy_(0, u.block_index.dev, u.block_ids.dev)
        if u.req_indices is None:
            return
        self.float_params.index_copy_(0, u.req_indices.dev, u.floats.dev)
        self.int_params.index_copy_(0, u.req_indices.dev, u.ints.dev)
        st = self.penalty
        if u.bias_ids is not None:
            st.bias_ids.index_copy_(0, u.req_indices.dev, u.bias_ids.dev)
            st.bias_values.index_copy_(0, u.req_indices.dev, u.bias_values.dev)
        if u.fresh is not None:
            st.counts.index_fill_(0, u.fresh.dev, 0)
            st.in_prompt.index_fill_(0, u.fresh.dev, False)

    def stage_counts(self, x: StepInputs, batch: UploadBatch) -> InputCounts | None:
        """Stage which of step ``x``'s input tokens ``count_inputs`` counts (None: no row penalized); call after
        ``stage``."""
        if self.penalty is None or not self.any_penalized:
            return None
        rows = np.flatnonzero(self.host_penalized[x.req_index])
        if not len(rows):
            return None
        q = x.num_scheduled_tokens[rows]
        row_of = np.repeat(rows, q)
        j = np.arange(int(q.sum())) - np.repeat(np.cumsum(q) - q, q)  # 0..q-1 within each row
        flat = (np.cumsum(x.num_scheduled_tokens) - x.num_scheduled_tokens)[row_of] + j
        req_index = x.req_index[row_of]
        is_output = x.start_pos[row_of] + j >= self.host_prompt_len[req_index]
        # A draft (a row's last num_draft_tokens) counts once it is accepted (speculation.SpecState.after_step),
        # not as an input.
        counted = is_output & (j < x.num_scheduled_tokens[row_of] - x.num_draft_tokens[row_of])
        return InputCounts(
            batch.add(flat[counted]),
            batch.add(req_index[counted]),
            batch.add(flat[~is_output]),
            batch.add(req_index[~is_output]),
            bool(counted.any()),
            not bool(is_output.all()),
        )

    def count_inputs(self, counts: InputCounts | None, input_ids: torch.Tensor) -> None:
        """Count penalized rows' input tokens on the device before the step samples (``input_ids``: ``[T]`` int64,
        resolved).

        Positions below ``prompt_len`` mark the prompt mask, others add to the output counts: every output token but the
        last is some step's input, so counts are exact without reading sampled tokens back.
        """
        if counts is None:
            return
        st = self.penalty
        if counts.any_output:
            st.counts.index_put_(
                (counts.out_req_index.dev, input_ids.index_select(0, counts.out_flat.dev)),
                st.counts.new_ones(()),
                accumulate=True,
            )
        if counts.any_prompt:
            st.in_prompt.index_put_(
                (counts.in_req_index.dev, input_ids.index_select(0, counts.in_flat.dev)), st.in_prompt.new_ones(())
            )
