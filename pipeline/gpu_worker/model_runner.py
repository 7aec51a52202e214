"""Turns a StepDescriptor into enqueued device work and, later, host tokens (docs/design.md, "The step protocol"; "The
worker").

``launch`` stages the step's host-decided arrays in one ``UploadBatch``, then writes rows, resolves placeholders,
forwards and samples, and starts the host copy; nothing on the device is read on the host until ``finish``
(``tests/unit/test_no_host_sync.py`` guards this).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.common.config import EngineConfig
from pipeline.common.step_output import LORA_FAILED
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID, StepInputs
from pipeline.gpu_worker.attention.backend import AttentionMetadata, StepLayout
from pipeline.gpu_worker.device import DeviceClock, DeviceOps, Staged, UploadBatch, device_ops
from pipeline.gpu_worker.executor import Executed, Executor, LogprobInputs, SamplingInputs
from pipeline.gpu_worker.input_batch import POISON_TOKEN_ID, InputBatch
from pipeline.gpu_worker.launched_step import LaunchedStep
from pipeline.gpu_worker.sampling.logprobs import PromptLogprobPlan
from pipeline.gpu_worker.sampling.mask_reader import MaskReader
from pipeline.gpu_worker.sampling.penalties import PenaltyPlan, plan_penalties
from pipeline.gpu_worker.sampling.rejection_sampler import VerifyInputs
from pipeline.gpu_worker.sampling.sampler import SamplingTensors
from pipeline.gpu_worker.spec.draft_model import DraftModel
from pipeline.gpu_worker.spec.speculation import SpecStep, spec_state

if TYPE_CHECKING:  # the simulated device never loads the model code
    from pipeline.gpu_worker.models.base import CausalLM

# The simulated device has no vocabulary: top-k is never clipped to it (np.iinfo costs 10 us a call).
_NO_VOCAB = np.iinfo(np.int64).max


@dataclass
class _Placeholders:
    """A step's input ids, and where placeholders are and which req_index each reads (staged; None: none)."""

    token_ids: Staged  # [T] int64
    index: Staged | None = None  # [P] int64 step-token index of each placeholder
    req_indices: Staged | None = None  # [P] int64 the req_index each reads
    host_req_indices: np.ndarray | None = None  # the same, on the host (poison mode names them)


@dataclass
class _Sampling:
    """A step's sampling decided on the host (staged arrays; None: not needed).

    ``last``/``sample_req_indices [S]``: step-token index and req_index of each sampled row; ``hot [R]``: rows with
    temperature > 0, ``host_hot_req`` their req_indices on the host.
    """

    last: Staged
    sample_req_indices: Staged
    hot: Staged | None = None
    hot_req_indices: Staged | None = None
    positions: Staged | None = None
    hot_rows: Staged | None = None  # descriptor row of each hot position, when rows may be shifted
    host_hot_req: np.ndarray | None = None
    mask_rows: Staged | None = None
    num_masks: int = 0  # sampled positions whose bitmask follows the descriptor (``MaskReader``)
    penalties: PenaltyPlan | None = None


@dataclass
class _Logprobs:
    """The staged arrays of ``LogprobInputs`` (None: none)."""

    rows: Staged | None = None
    prompt_positions: Staged | None = None
    prompt_targets: Staged | None = None


@dataclass
class _DeviceInputs:
    layout: StepLayout
    meta: AttentionMetadata
    sampling: SamplingInputs
    logprobs: LogprobInputs
    verify: VerifyInputs | None


class ModelRunner:
    """Runs steps of a model on one device (``executor``: ``ModelExecutor`` or ``SimExecutor``); ``masks`` must be set
    (by the worker) before a step with constrained rows."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        device: torch.device,
        ops: DeviceOps | None = None,
        draft_model: CausalLM | None = None,
    ):
        self.config, self.device, self.executor = config, device, executor
        self.ops = ops or device_ops(device)
        self.input_batch = InputBatch(
            config.scheduler.max_num_seqs, config.max_blocks_per_seq, self.ops, executor.vocab_size
        )
        self.poison = config.worker.debug_token_cache_poison
        draft = None
        if draft_model is not None:
            target = getattr(executor, "model", None)
            draft = DraftModel(draft_model, config, device, self.input_batch, self.ops, target)
        self.spec = spec_state(config, device, self.input_batch, draft)
        self.lora = getattr(executor, "lora", None)  # with --enable-lora
        self.clock = DeviceClock()
        self._in_flight = 0  # launched, not yet finished
        self.masks: MaskReader | None = None
        # The sampling of a batch with no row to sample with temperature: empty, never read.
        self._greedy = SamplingTensors.greedy(device), torch.zeros(0, dtype=torch.int64, device=device)

    @property
    def token_cache(self) -> torch.Tensor:
        """``[max_num_seqs]`` int64 on the device: the last token sampled at each req_index."""
        return self.input_batch.token_cache

    @torch.inference_mode()
    def launch(self, x: StepInputs, prepare_start_ns: int, meanwhile: Callable[[], None] | None = None) -> LaunchedStep:
        """Enqueue step ``x`` on the device: state updates, forward, sampling, host copy; one upload carries the staged
        arrays.

        ``prepare_start_ns`` (``time.monotonic_ns()``) starts the step's trace spans. ``meanwhile`` runs once the
        forward is enqueued (and, speculating, again before drafting): the worker publishes earlier outputs there.

        Raises:
            ValueError: a token id or position the model cannot take (on CUDA an asynchronous device assert).
        """
        step = LaunchedStep(step_id=x.step_id, req_num=x.req_num[x.sample_rows], prepare_start_ns=prepare_start_ns)
        if self.ops.is_async and self._in_flight == 0:
            # Idle device: this event runs at once, so it pins device time to host time.
            step.anchor = DeviceClock.anchor(self.ops.new_event(timing=True))
        self._check_inputs(x)
        batch = UploadBatch()
        update = self.input_batch.stage(x, batch)
        spec = self.spec.stage(x, batch) if self.spec is not None else None
        placeholders = self._stage_placeholders(x, batch)
        counts = self.input_batch.stage_counts(x, batch)
        sampling = self._stage_sampling(x, batch, spec)
        logprobs = self._stage_logprobs(x, step, batch, spec)
        batch.upload(self.ops)
        self.input_batch.write(update)
        input_ids = self._resolve_placeholders(placeholders, step)
        device_start = None
        if spec is not None:
            if spec.draft_plan is not None:  # the draft model's passes are the step's first device work
                step.start_event, device_start = self.ops.timing_event(), time.monotonic_ns()
            if (stale := self.spec.resolve_drafts(spec, input_ids)) is not None:
                step.add_stale(*stale)
        self.input_batch.count_inputs(counts, input_ids)
        if self.lora is not None and (unreadable := self.lora.prepare(x)) is not None:
            step.fail(unreadable, LORA_FAILED)
        inputs = self._device_inputs(x, input_ids, sampling, logprobs, spec, meanwhile)
        step.prepare_end_ns = time.monotonic_ns()
        if device_start is None:
            step.start_event, device_start = self.ops.timing_event(), time.monotonic_ns()
        executed = self.executor.execute(
            input_ids, inputs.meta, sampling.last.dev, inputs.sampling, inputs.logprobs, inputs.verify
        )
        if meanwhile is not None:
            meanwhile()
        self._record_sampled(executed, inputs, sampling.sample_req_indices.dev, input_ids, step, spec, meanwhile)
        self._stamp_launch(step, executed, device_start)
        step.start_host_copy(executed, self.ops)
        self._in_flight += 1
        return step

    def _check_inputs(self, x: StepInputs) -> None:
        """Refuse token ids and positions the model has no row for (host arrays only)."""
        vocab, max_pos = self.executor.vocab_size, self.executor.max_positions
        if vocab is not None and len(x.token_ids) and int(x.token_ids.max()) >= vocab:
            raise ValueError(
                f"step {x.step_id}: token id {int(x.token_ids.max())} is outside the vocabulary of {vocab}"
            )
        if max_pos is not None and len(x.start_pos) and int((x.start_pos + x.num_scheduled_tokens).max()) > max_pos:
            raise ValueError(f"step {x.step_id}: a position reaches max_position_embeddings {max_pos}")

    def _stage_placeholders(self, x: StepInputs, batch: UploadBatch) -> _Placeholders:
        """Stage the input ids and, if any, which of them are placeholders and whose req_index each reads."""
        ph = _Placeholders(batch.add(x.token_ids))
        is_placeholder = x.token_ids == PLACEHOLDER_TOKEN_ID
        if is_placeholder.any():
            idx = np.flatnonzero(is_placeholder)
            if len(x.token_ids) == len(x.req_index):  # one token per row (decode): token i is row i's
                ph_req_indices = x.req_index[idx]
            else:
                ph_req_indices = x.req_index[np.repeat(np.arange(len(x.req_index)), x.num_scheduled_tokens)[idx]]
            ph.index, ph.req_indices, ph.host_req_indices = batch.add(idx), batch.add(ph_req_indices), ph_req_indices
        return ph

    def _resolve_placeholders(self, ph: _Placeholders, step: LaunchedStep) -> torch.Tensor:
        """``[T]`` int64 device input ids, placeholders read from the token-id cache; in poison mode each consumed entry
        is poisoned and a per-placeholder stale flag goes to ``finish``."""
        input_ids = ph.token_ids.dev
        if ph.index is None:
            return input_ids
        cache = self.input_batch.token_cache
        resolved = cache.index_select(0, ph.req_indices.dev)
        if self.poison:
            step.add_stale((resolved < 0).long(), ph.host_req_indices)
            cache.index_fill_(0, ph.req_indices.dev, POISON_TOKEN_ID)
        # A stale read must not reach the embedding as a negative id (an
        # asynchronous device assert on CUDA); poison mode reports it in finish().
        input_ids.index_copy_(0, ph.index.dev, resolved.clamp(min=0))
        return input_ids

    def _stage_sampling(self, x: StepInputs, batch: UploadBatch, spec: SpecStep | None) -> _Sampling:
        """Stage the sampling of the step's sampled positions (``1 + K`` per row with drafts), decided from the host
        mirror of the rows' parameters; values are gathered on the device in ``_sampling_inputs``."""
        rows = x.sample_rows
        sample_req_indices = x.req_index[rows]
        sp = spec.sp if spec is not None and spec.sp.k else None
        if sp is None:
            # One token per row (decode): each row's last token is its own index.
            last = rows if len(x.token_ids) == len(x.req_index) else (np.cumsum(x.num_scheduled_tokens) - 1)[rows]
            positions = x.start_pos[rows] + x.num_scheduled_tokens[rows]
            pos_req, pos_rows = sample_req_indices, rows
        else:  # every position of a row that verifies drafts
            last, positions, pos_req, pos_rows = sp.token, sp.position, sample_req_indices[sp.row], rows[sp.row]
        s = self.input_batch
        out = _Sampling(batch.add(last), batch.add(sample_req_indices))
        hot = np.flatnonzero(s.host_temperature[pos_req] > 0) if s.any_hot else ()
        if len(hot):
            hot_req_indices = pos_req[hot]
            out.hot, out.hot_req_indices, out.positions = (
                batch.add(hot),
                batch.add(hot_req_indices),
                batch.add(positions[hot]),
            )
            out.host_hot_req = hot_req_indices
            if spec is not None and spec.shift_req is not None:
                out.hot_rows = batch.add(pos_rows[hot])
        if len(x.mask_row):  # structured output: the descriptor rows become sampled positions, a mask each
            masked = np.searchsorted(rows, x.mask_row)
            if sp is not None:  # every position of a row that verifies drafts
                count = sp.count[masked]
                masked = np.repeat(sp.first[masked] - (np.cumsum(count) - count), count) + np.arange(count.sum())
            out.mask_rows, out.num_masks = batch.add(masked), len(masked)
        if s.penalty is not None and s.any_penalty_work:
            # The scheduler drafts for a row only past its min_tokens: host positions decide that exactly.
            out.penalties = plan_penalties(
                pos_req,
                positions - s.host_prompt_len[pos_req],
                s.host_penalized[pos_req],
                s.host_num_bias[pos_req],
                s.host_min_tokens[pos_req],
                s.host_stop_ids,
                drafts_before=None if sp is None else sp.j,
                first_draft=None if sp is None else (sp.token[sp.first] + 1)[sp.row],
            )
            if out.penalties is not None:
                out.penalties.stage(batch)
        return out

    def _sampling_inputs(
        self,
        st: _Sampling,
        shift: torch.Tensor | None,
        input_ids: torch.Tensor,
        step_id: int,
        meanwhile: Callable[[], None] | None,
    ) -> SamplingInputs:
        """The ``SamplingInputs`` of a staged plan, parameters gathered on the device; ``shift`` moves shifted rows'
        positions back (the noise is keyed by the true one)."""
        s = self.input_batch
        if st.hot is None:
            sampling = SamplingInputs(*self._greedy)
        else:
            vocab = self.executor.vocab_size or _NO_VOCAB
            params = s.sampling_tensors(
                st.hot.dev, st.host_hot_req, st.hot_req_indices.dev, vocab, not self.ops.is_async
            )
            position = st.positions.dev
            if shift is not None and st.hot_rows is not None:
                position = position - shift.index_select(0, st.hot_rows.dev)
            sampling = SamplingInputs(params, position)
        if st.mask_rows is not None:
            sampling.mask_rows = st.mask_rows.dev
            sampling.await_bitmask = lambda: self._upload_masks(step_id, st.num_masks, meanwhile)
        if st.penalties is not None:
            sampling.penalty_state = s.penalty
            sampling.penalties = st.penalties.on_device(input_ids)
        return sampling

    def _stage_logprobs(
        self, x: StepInputs, step: LaunchedStep, batch: UploadBatch, spec: SpecStep | None
    ) -> _Logprobs:
        """Stage which sampled and prompt positions get log-probabilities, from the host mirror and
        ``PromptLogprobPlan``."""
        out = _Logprobs()
        wants = self.input_batch.host_logprobs[x.req_index[x.sample_rows]] >= 0 if self.input_batch.any_logprobs else ()
        if len(wants) and spec is not None and spec.sp.k:
            wants = wants[spec.sp.row]
        rows = np.flatnonzero(wants) if len(wants) else ()
        if len(rows):
            step.lp_rows, out.rows = rows, batch.add(rows)
        plan = PromptLogprobPlan.of(x)
        if plan is not None:
            step.prompt_plan = plan
            out.prompt_positions, out.prompt_targets = batch.add(plan.flat), batch.add(plan.next_token)
        return out

    def _device_inputs(
        self,
        x: StepInputs,
        input_ids: torch.Tensor,
        staged_sampling: _Sampling,
        staged_logprobs: _Logprobs,
        spec: SpecStep | None,
        meanwhile: Callable[[], None] | None,
    ) -> _DeviceInputs:
        """The attention metadata and the sampling, log-probability and verification inputs; ``meanwhile`` as
        ``launch`` (it may run while the masks are awaited)."""
        layout = StepLayout.build(
            x.num_scheduled_tokens,
            x.start_pos,
            x.req_index,
            self.config.scheduler.block_size,
            self.config.max_blocks_per_seq,
            x.num_draft_tokens,
        )
        shift = self.spec.shift(spec) if spec is not None else None
        meta = self.executor.build_metadata(layout, self.input_batch.block_table, self.ops.upload, shift)
        sampling = self._sampling_inputs(staged_sampling, shift, input_ids, x.step_id, meanwhile)
        logprobs = LogprobInputs(
            *(
                a.dev if a is not None else None
                for a in (staged_logprobs.rows, staged_logprobs.prompt_positions, staged_logprobs.prompt_targets)
            )
        )
        verify = self.spec.verify_inputs(spec, input_ids, meta) if spec is not None else None
        return _DeviceInputs(layout, meta, sampling, logprobs, verify)

    def _stamp_launch(self, step: LaunchedStep, executed: Executed, device_start: int) -> None:
        """The launch's end; where the host knows them, the device's start and end."""
        step.launch_ns = time.monotonic_ns()
        if executed.done is not None:  # the simulated device's own timeline
            step.device_start_ns, step.device_end_ns = executed.device_start_ns, executed.device_end_ns
        elif not self.ops.is_async:  # CPU torch ran the step synchronously: wall time around it
            step.device_start_ns, step.device_end_ns = device_start, step.launch_ns

    def _record_sampled(
        self,
        executed: Executed,
        inputs: _DeviceInputs,
        sample_req_indices: torch.Tensor,
        input_ids: torch.Tensor,
        step: LaunchedStep,
        spec: SpecStep | None,
        meanwhile: Callable[[], None] | None,
    ) -> None:
        """Write the sampled tokens into the token-id cache; speculating, the rows' state after verification and
        their next drafts instead."""
        if spec is None:
            self.input_batch.token_cache.index_copy_(0, sample_req_indices, executed.tokens)
        else:
            step.spec = spec.sp
            self.spec.after_step(spec, executed, inputs.meta, inputs.layout, input_ids, meanwhile)

    def _upload_masks(self, step_id: int, num_masks: int, meanwhile: Callable[[], None] | None) -> torch.Tensor:
        """``[M, W]`` int64 (int32 words, widened) on the device: step ``step_id``'s bitmasks, once written (a
        non-blocking copy, in stream order before the sampling)."""
        return self.ops.upload([self.masks.read(step_id, num_masks, meanwhile)])[0]

    def finish(self, step: LaunchedStep) -> LaunchedStep:
        """Wait for ``step``'s tokens on the host, fill its device times, then ``step.read_host_copy()``.

        Raises:
            StaleTokenError: in poison mode, if a placeholder (or draft) of the step read a consumed entry.
        """
        if step.done is not None:
            step.done.synchronize()
        self._in_flight -= 1
        if self.ops.is_async:
            step.device_start_ns, step.device_end_ns = self.clock.span(step.anchor, step.start_event, step.done)
        step.read_host_copy()
        return step
