"""Turns a StepDescriptor into enqueued device work and, later, host tokens.

:meth:`ModelRunner.launch` runs four named steps (docs/design.md, "The step
protocol"; "The worker"):

1. :meth:`~ModelRunner._apply_slot_updates`: new block-table entries and the
   sampling parameters of rows new in their slot;
2. :meth:`~ModelRunner._resolve_placeholders`: placeholder inputs read the
   token-id cache on the device (poison mode checks and poisons what they read);
3. :meth:`~ModelRunner._forward_and_sample`: attention metadata, then the
   :class:`~pipeline.gpu_worker.executor.Executor` (real model or simulated
   device); the sampled tokens go into the token-id cache;
4. :meth:`~ModelRunner._start_host_copy`: on CUDA the tokens travel to pinned
   host memory on a copy stream, and a per-step event says when they arrived.

Placeholders are resolved on the device, in stream order after the previous
step's sampler wrote the cache, so launching step N+1 needs no device->host
copy of step N's tokens. :meth:`ModelRunner.finish` collects a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.common.config import EngineConfig
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID, StepInputs
from pipeline.gpu_worker.executor import Executed, Executor, SamplingInputs
from pipeline.gpu_worker.sim_device import SimEvent

# Written into a token-id cache entry once a placeholder consumed it; reading
# it again means a placeholder resolved to a stale token.
POISON_TOKEN_ID = -7


class StaleTokenError(RuntimeError):
    """A placeholder resolved to a token-id cache entry that was already consumed."""


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued; :meth:`ModelRunner.finish` collects it.

    Times are ``time.monotonic_ns()``.
    """

    step_id: int
    req_num: np.ndarray  # [S] int64 of the sampled rows
    tokens: torch.Tensor | None  # [S] int64, host (pinned on CUDA) once ``done`` fires
    done: torch.cuda.Event | SimEvent | None  # None on CPU torch: the work already ran
    start_event: torch.cuda.Event | None
    prepare_start_ns: int
    prepare_end_ns: int
    launch_ns: int
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
    """

    def __init__(self, config: EngineConfig, executor: Executor, device: torch.device):
        self.config, self.device = config, device
        s = config.max_num_seqs
        self.executor = executor
        self.token_cache = torch.full((s,), POISON_TOKEN_ID, dtype=torch.int64, device=device)
        # The block table and sampling parameters stay on the host: attention
        # metadata and sampler decisions are built there, and each step takes
        # its own copy of the rows it uses, so later updates never reach a
        # step already queued on the device.
        self.block_table = np.zeros((s, config.max_blocks_per_seq), dtype=np.int64)
        self.temperature = np.zeros(s, dtype=np.float32)
        self.top_p = np.ones(s, dtype=np.float32)
        self.top_k = np.zeros(s, dtype=np.int32)
        self.seed = np.zeros(s, dtype=np.int64)
        self.poison = config.debug_token_cache_poison
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.copy_stream = torch.cuda.Stream(device)
            # Maps CUDA event times onto time.monotonic_ns (one sync at start-up).
            self._clock_event = torch.cuda.Event(enable_timing=True)
            self._clock_event.record()
            self._clock_event.synchronize()
            self._clock_ns = time.monotonic_ns()

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.is_cuda:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    @torch.inference_mode()
    def launch(self, x: StepInputs, prepare_start_ns: int) -> LaunchedStep:
        """Enqueue step ``x`` on the device: state updates, forward, sampling.

        ``prepare_start_ns`` (``time.monotonic_ns()``) is when the worker
        started reading the step; it goes into the step's trace spans.

        Every tensor the step reads is written in stream order before it, so
        per-slot state of steps still queued is never changed under them.

        Raises:
            StaleTokenError: in poison mode, if a placeholder reads a consumed entry.
        """
        self._apply_slot_updates(x)
        input_ids = self._resolve_placeholders(x)
        executed, prepare_end = self._forward_and_sample(x, input_ids)
        launch_ns = time.monotonic_ns()
        step = LaunchedStep(step_id=x.step_id, req_num=x.req_num[x.sample_rows], tokens=None, done=executed.done,
                            start_event=executed.start_event, prepare_start_ns=prepare_start_ns,
                            prepare_end_ns=prepare_end, launch_ns=launch_ns,
                            device_start_ns=executed.device_start_ns, device_end_ns=executed.device_end_ns)
        self._start_host_copy(step, executed)
        return step

    def _apply_slot_updates(self, x: StepInputs) -> None:
        """Block-table entries and the ``is_new`` rows' sampling parameters, per slot."""
        if x.new_blocks.shape[1]:
            self.block_table[x.new_blocks[0], x.new_blocks[1]] = x.new_blocks[2]
        if len(x.new_rows):
            slots = x.slot[x.new_rows]
            self.temperature[slots], self.top_p[slots] = x.temperature, x.top_p
            self.top_k[slots], self.seed[slots] = x.top_k, x.seed

    def _resolve_placeholders(self, x: StepInputs) -> torch.Tensor:
        """``[T]`` int64 device input ids, placeholders read from the token-id cache.

        In poison mode each consumed cache entry is overwritten with
        :data:`POISON_TOKEN_ID`, and a read of a poisoned entry raises.
        """
        is_placeholder = x.token_ids == PLACEHOLDER_TOKEN_ID
        input_ids = self._to_device(x.token_ids)
        if not is_placeholder.any():
            return input_ids
        idx = np.flatnonzero(is_placeholder)
        row_of_token = np.repeat(np.arange(len(x.slot)), x.query_lens)
        ph_slots = self._to_device(x.slot[row_of_token[idx]])
        resolved = self.token_cache[ph_slots]
        if self.poison:
            if bool((resolved < 0).any()):
                bad = x.slot[row_of_token[idx]][(resolved < 0).cpu().numpy()]
                raise StaleTokenError(f"step {x.step_id}: placeholder for slots {bad.tolist()} read a "
                                      "consumed token-id cache entry")
            self.token_cache[ph_slots] = POISON_TOKEN_ID
        input_ids[self._to_device(idx)] = resolved
        return input_ids

    def _forward_and_sample(self, x: StepInputs, input_ids: torch.Tensor) -> tuple[Executed, int]:
        """Build the attention metadata, run the executor, write the token-id cache.

        Returns:
            The executor's result and when preparation ended (``monotonic_ns``).
        """
        meta = self.executor.attn_backend.build_metadata(
            torch.from_numpy(x.query_lens), torch.from_numpy(x.start_pos),
            torch.from_numpy(self.block_table[x.slot]), self.config.block_size, self.device)
        prepare_end = time.monotonic_ns()

        last = np.cumsum(x.query_lens)[x.sample_rows] - 1
        sample_slots = x.slot[x.sample_rows]
        sampling = SamplingInputs(*(torch.from_numpy(a[sample_slots]) for a in (self.temperature, self.top_p,
                                                                                  self.top_k, self.seed)),
                                  position=torch.from_numpy(x.start_pos[x.sample_rows] + x.query_lens[x.sample_rows]))
        executed = self.executor.execute(input_ids, meta, last, sampling)
        self.token_cache[self._to_device(sample_slots)] = executed.tokens
        return executed, prepare_end

    def _start_host_copy(self, step: LaunchedStep, executed: Executed) -> None:
        """Give ``step`` its host tokens: on CUDA a pinned copy on the copy stream, gated by events."""
        tokens = executed.tokens
        if not self.is_cuda:  # CPU torch and the simulated device: already host tensors
            step.tokens = tokens
            return
        sampled = torch.cuda.Event()
        sampled.record()
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(sampled)
            host.copy_(tokens, non_blocking=True)
            step.done = torch.cuda.Event(enable_timing=True)
            step.done.record()
        # The device tensor must outlive the copy: tell the allocator.
        tokens.record_stream(self.copy_stream)
        step.tokens = host

    def finish(self, step: LaunchedStep) -> LaunchedStep:
        """Wait for ``step``'s tokens on the host and fill its device times."""
        if step.done is not None:
            step.done.synchronize()
        if self.is_cuda:
            step.device_start_ns = self._clock_ns + int(self._clock_event.elapsed_time(step.start_event) * 1e6)
            step.device_end_ns = self._clock_ns + int(self._clock_event.elapsed_time(step.done) * 1e6)
        return step
