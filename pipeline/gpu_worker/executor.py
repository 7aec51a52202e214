"""What the model runner drives: the real model or the simulated device.

:class:`~pipeline.gpu_worker.model_runner.ModelRunner` prepares a step (slot
updates, placeholder resolution, attention metadata) the same way for both;
an :class:`Executor` then turns the resolved inputs into sampled tokens
(docs/design.md, "The worker"; "The simulated device"). It owns what only
the forward pass needs (the KV cache) and says how the step is timed.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.common.config import EngineConfig
from pipeline.gpu_worker.attention import AttentionBackend, AttentionMetadata, default_backend
from pipeline.gpu_worker.sampler import sample
from pipeline.gpu_worker.sim_device import SimEvent, SimulatedDevice, sim_next_tokens


@dataclass
class SamplingInputs:
    """Per sampled row ``[S]`` host tensors: the row's slot parameters and the sampled position."""

    temperature: torch.Tensor  # float32, 0 = greedy
    top_p: torch.Tensor  # float32 in (0, 1]
    top_k: torch.Tensor  # int32, <= 0 disables
    seed: torch.Tensor  # int64
    position: torch.Tensor  # int64, position of the token being sampled


@dataclass
class Executed:
    """Tokens of one enqueued step and the handles that time it.

    Attributes:
        tokens: ``[S]`` int64 on the device (may still be being computed).
        start_event: CUDA only: recorded on the stream just before the forward.
        done: an event that fires when the tokens exist, if the executor
            has its own clock (the simulated device); else None.
        device_start_ns, device_end_ns: ``time.monotonic_ns()`` span of the
            device work when the executor knows it at launch (CPU torch: wall
            time around forward and sample; simulated: its timeline); 0 on
            CUDA, where the runner derives them from events in ``finish``.
    """

    tokens: torch.Tensor
    start_event: torch.cuda.Event | None = None
    done: SimEvent | None = None
    device_start_ns: int = 0
    device_end_ns: int = 0


class Executor(ABC):
    """Forward and sample, given a step's resolved inputs and its metadata.

    Attributes:
        attn_backend: builds the step's attention metadata (the runner calls
            it; the simulated device uses it for the host cost and positions).
    """

    attn_backend: AttentionBackend

    @abstractmethod
    def execute(self, input_ids: torch.Tensor, meta: AttentionMetadata, last: np.ndarray,
                sampling: SamplingInputs) -> Executed:
        """Enqueue the step's forward and sampling.

        Args:
            input_ids: ``[T]`` int64 on the device, placeholders resolved.
            meta: the step's attention metadata, on the device.
            last: ``[S]`` int64 host array, step-token index of each sampled row's last token.
            sampling: the sampled rows' parameters.
        """


class ModelExecutor(Executor):
    """The real Llama over a paged KV cache on ``device``.

    Args:
        config: gives the KV cache size (blocks, block size).
        model: a :class:`~pipeline.gpu_worker.model.LlamaForCausalLM` on ``device``.
        device: where the model lives.
        dtype: the KV cache dtype (the model's).
    """

    def __init__(self, config: EngineConfig, model, device: torch.device, dtype: torch.dtype):
        self.model, self.device = model, device
        self.attn_backend = model.attn_backend
        self.kv_caches = model.allocate_kv_caches(config.num_kv_blocks, config.block_size, dtype, device)
        self.is_cuda = device.type == "cuda"

    def execute(self, input_ids: torch.Tensor, meta: AttentionMetadata, last: np.ndarray,
                sampling: SamplingInputs) -> Executed:
        out = Executed(tokens=None)  # type: ignore[arg-type]
        if self.is_cuda:
            out.start_event = torch.cuda.Event(enable_timing=True)
            out.start_event.record()
        device_start = time.monotonic_ns()
        hidden = self.model(input_ids, meta.positions, meta, self.kv_caches)
        last_t = torch.from_numpy(last)
        if self.is_cuda:
            last_t = last_t.pin_memory().to(self.device, non_blocking=True)
        logits = self.model.compute_logits(hidden[last_t])
        # Seeded noise is keyed by the sampled token's position, so a request
        # draws the same noise whatever batch it is in.
        out.tokens = sample(logits, sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed,
                            sampling.position)
        if not self.is_cuda:  # CPU torch ran the step synchronously: wall time around it
            out.device_start_ns, out.device_end_ns = device_start, time.monotonic_ns()
        return out


class SimExecutor(Executor):
    """The simulated device: deterministic tokens, computed timeline (see :mod:`.sim_device`).

    Its "device" is host memory, so it reads the resolved inputs directly.
    Sampling parameters are ignored.
    """

    def __init__(self, sim: SimulatedDevice):
        self.sim = sim
        self.attn_backend = default_backend()

    def execute(self, input_ids: torch.Tensor, meta: AttentionMetadata, last: np.ndarray,
                sampling: SamplingInputs) -> Executed:
        # The simulated kernel reads the resolved inputs like the model would.
        tokens = torch.from_numpy(sim_next_tokens(input_ids[last].numpy(), meta.positions[last].numpy()))
        start, end = self.sim.enqueue_step(input_ids.numel())
        return Executed(tokens=tokens, done=SimEvent(end), device_start_ns=start, device_end_ns=end)
