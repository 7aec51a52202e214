"""Turns a StepDescriptor into enqueued device work and, later, host tokens.

:meth:`ModelRunner.launch` runs four named steps (docs/design.md, "The step
protocol"; "The worker"):

1. :meth:`~ModelRunner._apply_slot_updates`: new block-table entries and the
   sampling parameters of rows new in their slot, written on the device;
2. :meth:`~ModelRunner._resolve_placeholders`: placeholder inputs read the
   token-id cache on the device; poison mode poisons what they read and
   computes a "stale" flag on the device; the inputs of slots with penalties
   are counted on the device (``SlotState.count_inputs``);
3. :meth:`~ModelRunner._forward_and_sample`: attention metadata, then the
   :class:`~pipeline.gpu_worker.executor.Executor` (real model or simulated
   device), which also computes the log-probabilities asked for from the
   same forward; the sampled tokens go into the token-id cache;
4. :meth:`~ModelRunner._start_host_copy`: the tokens, the stale flags and the
   log-probabilities travel together to pinned host memory on a copy stream
   (one copy); an event says when.

On a GPU none of these waits for the device: inputs go up through pinned
staging buffers, decisions are taken from host copies of the descriptor and
of the per-slot parameters, and nothing device-side is read on the host until
:meth:`ModelRunner.finish`, which the worker calls once the step's event has
fired. ``tests/unit/test_no_host_sync.py`` guards this.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.common.config import EngineConfig
from pipeline.common.step_protocol import MAX_LOGPROBS, PLACEHOLDER_TOKEN_ID, StepInputs, TokenLogprobs
from pipeline.gpu_worker.attention.backend import StepLayout
from pipeline.gpu_worker.device import DeviceClock, DeviceOps, device_ops
from pipeline.gpu_worker.executor import Executed, Executor, LogprobInputs, LogprobTensors, SamplingInputs
from pipeline.gpu_worker.logprobs import PromptLogprobPlan
from pipeline.gpu_worker.penalties import plan_penalties
from pipeline.gpu_worker.sampler import SamplingPlan
from pipeline.gpu_worker.slot_state import POISON_TOKEN_ID, SlotState

__all__ = ["POISON_TOKEN_ID", "LaunchedStep", "ModelRunner", "StaleTokenError"]


class StaleTokenError(RuntimeError):
    """A placeholder resolved to a token-id cache entry that was already consumed."""


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued; :meth:`ModelRunner.finish` collects it.

    Times are ``time.monotonic_ns()``. ``tokens`` and ``stale`` are host
    tensors whose contents are valid once ``done`` has fired; ``logprobs``
    and ``prompt_logprobs`` are filled by :meth:`ModelRunner.finish`.
    """

    step_id: int
    req_num: np.ndarray  # [S] int64 of the sampled rows
    prepare_start_ns: int
    tokens: torch.Tensor | None = None  # [S] int64 (pinned on CUDA)
    done: object | None = None  # CUDA or simulated event; None on CPU torch: the work already ran
    start_event: torch.cuda.Event | None = None  # CUDA: recorded before the forward
    anchor: tuple[object, int] | None = None  # CUDA: (event, host ns) if launched on an idle device
    stale: torch.Tensor | None = None  # poison mode: [P] int64, 1 where a placeholder read a poisoned entry
    stale_slots: np.ndarray | None = None  # [P] the slot each placeholder read
    lp_rows: np.ndarray | None = None  # [L] output rows whose request asked for log-probabilities
    prompt_plan: PromptLogprobPlan | None = None  # the prompt positions whose log-probabilities are computed
    lp_host: torch.Tensor | None = None  # packed log-probabilities (see ModelRunner._start_host_copy)
    logprobs: TokenLogprobs | None = None  # index = output row
    prompt_logprobs: TokenLogprobs | None = None  # index = request number, with positions
    prepare_end_ns: int = 0
    launch_ns: int = 0
    device_start_ns: int = 0  # on CUDA derived from the events in finish()
    device_end_ns: int = 0

    def is_done(self) -> bool:
        return self.done is None or self.done.query()


class ModelRunner:
    """Runs steps of a model on one device.

    Args:
        config: the engine configuration (slots, blocks, block size).
        executor: the real model (:class:`~pipeline.gpu_worker.executor.ModelExecutor`)
            or the simulated device (:class:`~pipeline.gpu_worker.executor.SimExecutor`,
            which replaces only the forward pass and the sampling kernel).
        device: where the model and all per-slot state live.
        ops: how data moves to and from ``device``; default :func:`~pipeline.gpu_worker.device.device_ops`.
    """

    def __init__(self, config: EngineConfig, executor: Executor, device: torch.device, ops: DeviceOps | None = None):
        self.config, self.device, self.executor = config, device, executor
        self.ops = ops or device_ops(device)
        self.slots = SlotState(config.max_num_seqs, config.max_blocks_per_seq, self.ops, executor.vocab_size)
        self.poison = config.debug_token_cache_poison
        self.clock = DeviceClock()
        self._in_flight = 0  # launched, not yet finished

    @property
    def token_cache(self) -> torch.Tensor:
        """``[max_num_seqs]`` int64 on the device: the last token sampled in each slot."""
        return self.slots.token_cache

    @torch.inference_mode()
    def launch(self, x: StepInputs, prepare_start_ns: int) -> LaunchedStep:
        """Enqueue step ``x`` on the device: state updates, forward, sampling, host copy.

        ``prepare_start_ns`` (``time.monotonic_ns()``) is when the worker
        started reading the step; it goes into the step's trace spans. Every
        tensor the step reads is written in stream order before it, so
        per-slot state of steps still queued is never changed under them.

        Raises:
            ValueError: a token id or position the model cannot take (checked
                on the host: on CUDA it would be an asynchronous device assert).
        """
        step = LaunchedStep(step_id=x.step_id, req_num=x.req_num[x.sample_rows], prepare_start_ns=prepare_start_ns)
        if self.ops.is_async and self._in_flight == 0:
            # Idle device: this event runs at once, so it pins device time to host time.
            step.anchor = DeviceClock.anchor(self.ops.new_event(timing=True))
        self._check_inputs(x)
        self._apply_slot_updates(x)
        input_ids = self._resolve_placeholders(x, step)
        self.slots.count_inputs(x, input_ids)
        executed = self._forward_and_sample(x, input_ids, step)
        self._start_host_copy(step, executed)
        self._in_flight += 1
        return step

    def _check_inputs(self, x: StepInputs) -> None:
        """Refuse token ids and positions the model has no row for (host arrays only)."""
        vocab, max_pos = self.executor.vocab_size, self.executor.max_positions
        if vocab is not None and len(x.token_ids) and int(x.token_ids.max()) >= vocab:
            raise ValueError(f"step {x.step_id}: token id {int(x.token_ids.max())} is outside the vocabulary "
                             f"of {vocab}")
        if max_pos is not None and len(x.start_pos) and int((x.start_pos + x.query_lens).max()) > max_pos:
            raise ValueError(f"step {x.step_id}: a position reaches max_position_embeddings {max_pos}")

    def _apply_slot_updates(self, x: StepInputs) -> None:
        """Block-table entries and the sampling parameters of rows new in their slot, on the device."""
        self.slots.apply(x)

    def _resolve_placeholders(self, x: StepInputs, step: LaunchedStep) -> torch.Tensor:
        """``[T]`` int64 device input ids, placeholders read from the token-id cache.

        In poison mode each consumed cache entry is overwritten with
        :data:`POISON_TOKEN_ID`, and ``step.stale`` gets, per placeholder, a
        device flag "read a poisoned entry" that :meth:`finish` checks.
        """
        is_placeholder = x.token_ids == PLACEHOLDER_TOKEN_ID
        if not is_placeholder.any():
            return self.ops.upload([x.token_ids])[0]
        idx = np.flatnonzero(is_placeholder)
        row_of_token = np.repeat(np.arange(len(x.slot)), x.query_lens)
        ph_slots = x.slot[row_of_token[idx]]
        input_ids, idx_d, ph_slots_d = self.ops.upload([x.token_ids, idx, ph_slots])
        cache = self.slots.token_cache
        resolved = cache.index_select(0, ph_slots_d)
        if self.poison:
            step.stale, step.stale_slots = (resolved < 0).long(), ph_slots
            cache.index_fill_(0, ph_slots_d, POISON_TOKEN_ID)
        # A stale read must not reach the embedding as a negative id (an
        # asynchronous device assert on CUDA); poison mode reports it in finish().
        input_ids.index_copy_(0, idx_d, resolved.clamp(min=0))
        return input_ids

    def _sampling_inputs(self, x: StepInputs) -> tuple[torch.Tensor, torch.Tensor, SamplingInputs]:
        """``(last [S], sample slots [S], sampling)`` on the device for the sampled rows.

        Which rows are greedy, what filtering runs and which rows get
        penalties is decided from the host mirror of the slots' parameters
        and the descriptor's positions; the values are gathered from the
        device copy.
        """
        rows = x.sample_rows
        last = (np.cumsum(x.query_lens) - 1)[rows]
        sample_slots = x.slot[rows]
        positions = x.start_pos[rows] + x.query_lens[rows]
        hot = np.flatnonzero(self.slots.host_temperature[sample_slots] > 0)
        hot_slots = sample_slots[hot]
        last_d, slots_d, hot_d, hot_slots_d, positions_d = self.ops.upload(
            [last, sample_slots, hot, hot_slots, positions[hot]])
        s = self.slots
        plan = SamplingPlan.build(hot_d if hot.size else None, s.host_top_k[hot_slots], s.host_top_p[hot_slots],
                                  self.executor.vocab_size or np.iinfo(np.int64).max,
                                  host_reads_ok=not self.ops.is_async, min_p=s.host_min_p[hot_slots])
        sampling = SamplingInputs(plan, *(t.index_select(0, hot_slots_d) for t in (s.temperature, s.top_p, s.top_k,
                                                                                   s.seed)), position=positions_d,
                                  min_p=s.min_p.index_select(0, hot_slots_d))
        if len(x.mask_rows):  # structured output: the descriptor rows become sampled-row indices
            sampling.mask_rows, sampling.bitmask = self.ops.upload([np.searchsorted(rows, x.mask_rows), x.bitmask])
        if s.penalty is not None:
            sampling.penalty_state = s.penalty
            sampling.penalties = plan_penalties(
                sample_slots, positions - s.host_prompt_len[sample_slots], s.host_penalized[sample_slots],
                s.host_num_bias[sample_slots], s.host_min_tokens[sample_slots],
                s.host_stop_ids, self.ops.upload)
        return last_d, slots_d, sampling

    def _logprob_inputs(self, x: StepInputs, step: LaunchedStep) -> LogprobInputs:
        """Which sampled rows and prompt positions get log-probabilities, decided on the host.

        Sampled rows come from the host mirror of the slots' ``logprobs``;
        prompt positions from the descriptor (:class:`PromptLogprobPlan`).
        """
        out = LogprobInputs()
        rows = np.flatnonzero(self.slots.host_logprobs[x.slot[x.sample_rows]] >= 0)
        plan = PromptLogprobPlan.of(x)
        arrays = ([rows] if len(rows) else []) + ([plan.flat, plan.next_token] if plan is not None else [])
        if not arrays:
            return out
        uploaded = self.ops.upload(arrays)
        if len(rows):
            step.lp_rows, out.rows = rows, uploaded.pop(0)
        if plan is not None:
            step.prompt_plan, (out.prompt_positions, out.prompt_targets) = plan, uploaded
        return out

    def _forward_and_sample(self, x: StepInputs, input_ids: torch.Tensor, step: LaunchedStep) -> Executed:
        """Build the attention metadata, run the executor, write the token-id cache."""
        layout = StepLayout.build(x.query_lens, x.start_pos, x.slot, self.config.block_size,
                                  self.config.max_blocks_per_seq)
        meta = self.executor.attn_backend.build_metadata(layout, self.slots.block_table, self.ops.upload)
        last, sample_slots, sampling = self._sampling_inputs(x)
        logprobs = self._logprob_inputs(x, step)
        step.prepare_end_ns = time.monotonic_ns()

        step.start_event = self.ops.timing_event()
        device_start = time.monotonic_ns()
        executed = self.executor.execute(input_ids, meta, last, sampling, logprobs)
        self.slots.token_cache.index_copy_(0, sample_slots, executed.tokens)
        step.launch_ns = time.monotonic_ns()
        if executed.done is not None:  # the simulated device's own timeline
            step.device_start_ns, step.device_end_ns = executed.device_start_ns, executed.device_end_ns
        elif not self.ops.is_async:  # CPU torch ran the step synchronously: wall time around it
            step.device_start_ns, step.device_end_ns = device_start, step.launch_ns
        return executed

    def _start_host_copy(self, step: LaunchedStep, executed: Executed) -> None:
        """Start copying the tokens, poison flags and log-probabilities to the host, in one copy.

        Everything travels as one int64 tensor, so one event says when all
        of it has arrived: the tokens, then the stale flags, then per
        log-probability set ``N`` values, ``N x MAX_LOGPROBS`` ids and ``N x
        MAX_LOGPROBS`` values, float32 travelling as their int32 bit patterns.
        ``step.done`` fires when they are there.
        """
        tokens = executed.tokens
        parts = [tokens] + ([step.stale] if step.stale is not None else [])
        for lp in (executed.logprobs, executed.prompt_logprobs):
            if lp is not None:
                parts.extend(_pack(lp))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        host, done = self.ops.copy_to_host(out)
        num_sampled = tokens.shape[0]
        step.tokens = host[:num_sampled]
        end = num_sampled
        if step.stale is not None:
            end += step.stale.shape[0]
            step.stale = host[num_sampled:end]
        step.lp_host = host[end:]
        step.done = executed.done if executed.done is not None else done

    def finish(self, step: LaunchedStep) -> LaunchedStep:
        """Wait for ``step``'s tokens on the host and fill its device times.

        Raises:
            StaleTokenError: in poison mode, if a placeholder of the step read a consumed entry.
        """
        if step.done is not None:
            step.done.synchronize()
        self._in_flight -= 1
        if self.ops.is_async:
            step.device_start_ns, step.device_end_ns = self.clock.span(step.anchor, step.start_event, step.done)
        if step.stale is not None:
            bad = step.stale.numpy().astype(bool)
            if bad.any():
                raise StaleTokenError(f"step {step.step_id}: placeholder for slots {step.stale_slots[bad].tolist()} "
                                      "read a consumed token-id cache entry")
        packed, offset = step.lp_host.numpy() if step.lp_host is not None else None, 0
        if step.lp_rows is not None:
            step.logprobs, offset = _unpack(packed, offset, step.lp_rows)
        if step.prompt_plan is not None:
            plan = step.prompt_plan
            step.prompt_logprobs, offset = _unpack(packed, offset, plan.req_num)
            step.prompt_logprobs.pos = plan.pos
        return step


def _pack(lp: LogprobTensors) -> list[torch.Tensor]:
    """One log-probability set as flat int64 tensors: float32 values as their bit patterns."""
    logprob, top_ids, top_logprobs = lp
    return [logprob.contiguous().view(torch.int32).long(), top_ids.reshape(-1).long(),
            top_logprobs.contiguous().view(torch.int32).reshape(-1).long()]


def _unpack(packed: np.ndarray, offset: int, index: np.ndarray) -> tuple[TokenLogprobs, int]:
    """Read back one set packed by :func:`_pack` at ``offset``; returns it and the offset after it."""
    n, k = len(index), MAX_LOGPROBS
    logprob = packed[offset:offset + n].astype(np.int32).view(np.float32)
    top_ids = packed[offset + n:offset + n + n * k].astype(np.int32).reshape(n, k)
    top_logprobs = packed[offset + n + n * k:offset + n + 2 * n * k].astype(np.int32).view(np.float32).reshape(n, k)
    return TokenLogprobs(index.astype(np.int64), logprob, top_ids, top_logprobs), offset + n + 2 * n * k
