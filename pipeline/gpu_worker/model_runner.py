"""Turns a StepDescriptor into a forward pass and sampled tokens.

The runner keeps per-slot state on the device (docs/design.md, "The step
protocol"): the token-id cache (last token sampled for each slot), the
block table, and sampling parameters. Placeholder input tokens are resolved
from the token-id cache on the device, in stream order after the previous
step's sampler wrote it, so launching step N+1 needs no device->host copy of
step N's tokens. On CUDA the sampled tokens travel to pinned host memory on a
separate copy stream and a per-step event says when they have arrived.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.common.config import EngineConfig
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID, StepInputs
from pipeline.gpu_worker.attention import AttentionMetadata
from pipeline.gpu_worker.sampler import sample
from pipeline.gpu_worker.sim_device import SimEvent, SimulatedDevice, sim_next_tokens

# Written into a token-id cache entry once a placeholder consumed it; reading
# it again means a placeholder resolved to a stale token.
POISON_TOKEN_ID = -7


class StaleTokenError(RuntimeError):
    """A placeholder resolved to a token-id cache entry that was already consumed."""


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued; :meth:`ModelRunner.finish` collects it."""

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
        model: a :class:`pipeline.gpu_worker.model.LlamaForCausalLM` on
            ``device``, or a :class:`SimulatedDevice` that replaces the forward
            pass and sampling kernel (everything else runs unchanged).
        device: where the model and all per-slot state live.
        dtype: the KV cache dtype (the model's).
    """

    def __init__(self, config: EngineConfig, model, device: torch.device, dtype: torch.dtype):
        self.config, self.device = config, device
        s = config.max_num_seqs
        self.sim = model if isinstance(model, SimulatedDevice) else None
        self.model = None if self.sim else model
        self.kv_caches = [] if self.sim else model.allocate_kv_caches(config.num_kv_blocks, config.block_size,
                                                                      dtype, device)
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
        dev = self._to_device
        if x.new_blocks.shape[1]:
            self.block_table[x.new_blocks[0], x.new_blocks[1]] = x.new_blocks[2]
        if len(x.new_rows):
            slots = x.slot[x.new_rows]
            self.temperature[slots], self.top_p[slots] = x.temperature, x.top_p
            self.top_k[slots], self.seed[slots] = x.top_k, x.seed

        is_placeholder = x.token_ids == PLACEHOLDER_TOKEN_ID

        input_ids = dev(x.token_ids)
        if is_placeholder.any():
            idx = np.flatnonzero(is_placeholder)
            row_of_token = np.repeat(np.arange(len(x.slot)), x.query_lens)
            ph_slots = dev(x.slot[row_of_token[idx]])
            resolved = self.token_cache[ph_slots]
            if self.poison:
                if bool((resolved < 0).any()):
                    bad = x.slot[row_of_token[idx]][(resolved < 0).cpu().numpy()]
                    raise StaleTokenError(f"step {x.step_id}: placeholder for slots {bad.tolist()} read a "
                                          "consumed token-id cache entry")
                self.token_cache[ph_slots] = POISON_TOKEN_ID
            input_ids[dev(idx)] = resolved

        meta = AttentionMetadata.build(torch.from_numpy(x.query_lens), torch.from_numpy(x.start_pos),
                                       torch.from_numpy(self.block_table[x.slot]), self.config.block_size)
        if self.is_cuda:
            meta = meta.to(self.device, non_blocking=True)
        prepare_end = time.monotonic_ns()

        last = np.cumsum(x.query_lens)[x.sample_rows] - 1
        sample_slots = x.slot[x.sample_rows]
        sample_slots_t = dev(sample_slots)
        step = LaunchedStep(step_id=x.step_id, req_num=x.req_num[x.sample_rows], tokens=None, done=None,
                            start_event=None, prepare_start_ns=prepare_start_ns, prepare_end_ns=prepare_end,
                            launch_ns=0)
        if self.sim is not None:
            # The simulated kernel reads the resolved inputs like the model would.
            tokens = torch.from_numpy(sim_next_tokens(input_ids[last].numpy(), meta.positions[last].numpy()))
            self.token_cache[sample_slots_t] = tokens
            step.device_start_ns, step.device_end_ns = self.sim.enqueue_step(len(x.token_ids))
            step.done = SimEvent(step.device_end_ns)
            step.tokens = tokens
            step.launch_ns = time.monotonic_ns()
            return step

        if self.is_cuda:
            step.start_event = torch.cuda.Event(enable_timing=True)
            step.start_event.record()
        device_start = time.monotonic_ns()
        hidden = self.model(input_ids, meta.positions, meta, self.kv_caches)
        logits = self.model.compute_logits(hidden[dev(last)])
        # Seeded noise is keyed by the sampled token's position, so a request
        # draws the same noise whatever batch it is in.
        tokens = sample(logits, *(torch.from_numpy(a[sample_slots]) for a in (self.temperature, self.top_p,
                                                                              self.top_k, self.seed)),
                        torch.from_numpy(x.start_pos[x.sample_rows] + x.query_lens[x.sample_rows]))
        self.token_cache[sample_slots_t] = tokens
        step.launch_ns = time.monotonic_ns()
        if self.is_cuda:
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
        else:  # CPU torch ran the step synchronously: wall time around it
            step.tokens = tokens
            step.device_start_ns, step.device_end_ns = device_start, step.launch_ns
        return step

    def finish(self, step: LaunchedStep) -> LaunchedStep:
        """Wait for ``step``'s tokens on the host and fill its device times."""
        if step.done is not None:
            step.done.synchronize()
        if self.is_cuda:
            step.device_start_ns = self._clock_ns + int(self._clock_event.elapsed_time(step.start_event) * 1e6)
            step.device_end_ns = self._clock_ns + int(self._clock_event.elapsed_time(step.done) * 1e6)
        return step
