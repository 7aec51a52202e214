"""What the model runner drives: the real model or the simulated device.

:class:`~pipeline.gpu_worker.model_runner.ModelRunner` prepares a step (slot
updates, placeholder resolution, attention metadata) the same way for both;
an :class:`Executor` then turns the resolved inputs into sampled tokens
(docs/design.md, "The worker"; "The simulated device"). It owns what only
the forward pass needs (the KV cache).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pipeline.common.config import EngineConfig
from pipeline.gpu_worker.attention import AttentionBackend, AttentionMetadata, default_backend
from pipeline.gpu_worker.cuda_graphs import PAD_BLOCKS, GraphStep
from pipeline.gpu_worker.sampler import SamplingPlan, sample_rows
from pipeline.gpu_worker.sim_device import SimEvent, SimulatedDevice, sim_next_tokens


@dataclass
class SamplingInputs:
    """How to sample a step's ``S`` sampled rows.

    ``plan.rows`` selects the ``R`` rows with temperature > 0; the five
    tensors are ``[R]`` on the device, for those rows: ``temperature`` and
    ``top_p`` float32, ``top_k`` (0 = off), ``seed`` and ``position`` (of the
    token being sampled) int64.
    """

    plan: SamplingPlan
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor


@dataclass
class Executed:
    """Tokens of one enqueued step, and the step's timeline if the executor has its own clock.

    Attributes:
        tokens: ``[S]`` int64 on the device (may still be being computed).
        done: fires when the tokens exist (the simulated device); None otherwise.
        device_start_ns, device_end_ns: the simulated timeline (``time.monotonic_ns()``); 0 otherwise.
    """

    tokens: torch.Tensor
    done: SimEvent | None = None
    device_start_ns: int = 0
    device_end_ns: int = 0


class Executor(ABC):
    """Forward and sample, given a step's resolved inputs and its metadata.

    Attributes:
        attn_backend: builds the step's attention metadata (the runner calls
            it; the simulated device uses it for the host cost and positions).
        vocab_size: token ids must be below it (None: no limit of its own).
        max_positions: positions must be below it (None: no limit of its own).
    """

    attn_backend: AttentionBackend
    vocab_size: int | None = None
    max_positions: int | None = None

    @abstractmethod
    def execute(self, input_ids: torch.Tensor, meta: AttentionMetadata, last: torch.Tensor,
                sampling: SamplingInputs) -> Executed:
        """Enqueue the step's forward and sampling; must not wait for the device.

        Args:
            input_ids: ``[T]`` int64 on the device, placeholders resolved.
            meta: the step's attention metadata, on the device.
            last: ``[S]`` int64 on the device, step-token index of each sampled row's last token.
            sampling: how to sample those rows.
        """


class ModelExecutor(Executor):
    """The real Llama over a paged KV cache on ``device``.

    Args:
        config: gives the KV cache size (blocks, block size) and ``max_model_len``.
        model: a :class:`~pipeline.gpu_worker.model.LlamaForCausalLM` on ``device``.
        device: where the model lives.
        dtype: the KV cache dtype (the model's).

    The KV cache holds :data:`~pipeline.gpu_worker.cuda_graphs.PAD_BLOCKS`
    blocks beyond ``config.num_kv_blocks``, which the scheduler never hands
    out: the padding rows of CUDA graph steps write there.

    Raises:
        ValueError: ``config.max_model_len`` exceeds the model's
            ``max_position_embeddings`` (a position past the RoPE table is an
            asynchronous device assert on CUDA, so it is refused up front).
    """

    def __init__(self, config: EngineConfig, model, device: torch.device, dtype: torch.dtype):
        self.max_positions = int(model.config.max_position_embeddings)
        if config.max_model_len > self.max_positions:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                             f"{self.max_positions}; lower --max-model-len")
        self.vocab_size = int(model.config.vocab_size)
        self.model = model
        self.attn_backend = model.attn_backend
        self.kv_caches = model.allocate_kv_caches(config.num_kv_blocks + PAD_BLOCKS, config.block_size, dtype,
                                                  device)

    def execute(self, input_ids: torch.Tensor, meta: AttentionMetadata, last: torch.Tensor,
                sampling: SamplingInputs) -> Executed:
        if isinstance(meta, GraphStep):  # a decode-only step: its CUDA graph, docs/design.md, "The worker"
            logits = meta.run(input_ids).index_select(0, last)
        else:
            hidden = self.model(input_ids, meta.positions, meta, self.kv_caches)
            logits = self.model.compute_logits(hidden.index_select(0, last))
        # Seeded noise is keyed by the sampled token's position, so a request
        # draws the same noise whatever batch it is in.
        s = sampling
        return Executed(tokens=sample_rows(logits, s.plan, s.temperature, s.top_p, s.top_k, s.seed, s.position))


class SimExecutor(Executor):
    """The simulated device: deterministic tokens, computed timeline (see :mod:`.sim_device`).

    Its "device" is host memory, so it reads the resolved inputs directly
    (a real device would compute the tokens on the device). Sampling
    parameters are ignored.

    Args:
        sim: the simulated device's timeline.
        attn_backend: builds the step's metadata, as it would for a model
            (docs/design.md, "The simulated device"); default
            :func:`~pipeline.gpu_worker.attention.default_backend`.
    """

    def __init__(self, sim: SimulatedDevice, attn_backend: AttentionBackend | None = None):
        self.sim = sim
        self.attn_backend = attn_backend or default_backend()

    def execute(self, input_ids: torch.Tensor, meta: AttentionMetadata, last: torch.Tensor,
                sampling: SamplingInputs) -> Executed:
        # The simulated kernel reads the resolved inputs like the model would.
        tokens = torch.from_numpy(sim_next_tokens(input_ids[last].numpy(), meta.positions[last].numpy()))
        start, end = self.sim.enqueue_step(input_ids.numel())
        return Executed(tokens=tokens, done=SimEvent(end), device_start_ns=start, device_end_ns=end)
