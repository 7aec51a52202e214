"""What the model runner drives: the real model or the simulated device (docs/design.md, "The worker"; "The simulated
device"). ``ModelRunner`` prepares steps alike for both; the ``Executor`` turns them into sampled tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.common.config import EngineConfig
from pipeline.common.constants import cdiv
from pipeline.gpu_worker.attention import default_backend
from pipeline.gpu_worker.attention.backend import AttentionBackend, AttentionMetadata, StepLayout, Upload
from pipeline.gpu_worker.cuda_graphs import DecodeGraphs, GraphStep
from pipeline.gpu_worker.sampling.logprobs import token_logprobs
from pipeline.gpu_worker.sampling.penalties import PenaltyInputs, PenaltyState, apply_penalties
from pipeline.gpu_worker.sampling.rejection_sampler import VerifyInputs, accept_one_hot, rejection_sample
from pipeline.gpu_worker.sampling.sampler import SamplingTensors, filtered_logits, race, sample_rows
from pipeline.gpu_worker.sampling.token_mask import apply_token_bitmask, nearest_allowed
from pipeline.gpu_worker.sim_device import SimEvent, SimulatedDevice, sim_logprobs, sim_next_tokens

# Prompt log-probabilities go through the LM head this many positions at a
# time, so a long prefill chunk never holds a [chunk, vocab] float32 block.
_PROMPT_LOGITS_ROWS = 1024

# KV blocks allocated beyond config.num_kv_blocks: block num_kv_blocks is the padding block, which the
# scheduler never hands out and the padding rows of CUDA graph steps write.
PAD_BLOCKS = 1

# (logprob [N] float32, top_ids [N, MAX_LOGPROBS] int32, top_logprobs [N, MAX_LOGPROBS] float32) on the device.
LogprobTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class SamplingInputs:
    """How to sample a step's ``S`` sampled rows (docs/design.md, "Structured output").

    ``params.plan.rows`` selects the ``R`` rows with temperature > 0; ``position`` (``[R]`` int64 on the device) keys
    each one's noise. ``mask_rows`` (``[M]`` int64) get ``bitmask`` (``[M, W]``), or ``await_bitmask`` supplies it after
    the forward is enqueued.
    """

    params: SamplingTensors
    position: torch.Tensor
    penalties: PenaltyInputs | None = None
    penalty_state: PenaltyState | None = None
    mask_rows: torch.Tensor | None = None
    bitmask: torch.Tensor | None = None
    await_bitmask: Callable[[], torch.Tensor] | None = None

    def processed_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalties and biases, then the grammar's mask (last, so nothing revives a rejected token), on a copy of the
        raw ``[S, V]`` float32 ``logits``; may wait for the masks, never for the device."""
        penalized = apply_penalties(logits, self.penalties, self.penalty_state)
        return apply_token_bitmask(penalized, self.mask_rows, self.resolved_bitmask())

    def resolved_bitmask(self) -> torch.Tensor | None:
        """``bitmask``, from ``await_bitmask`` first if it is still to come."""
        if self.await_bitmask is not None:
            self.bitmask, self.await_bitmask = self.await_bitmask(), None
        return self.bitmask


@dataclass
class LogprobInputs:
    """Which log-probabilities a step computes (docs/design.md, "The step protocol"); int64 on the device, None for
    none.

    ``rows``: ``[L]`` sampled rows asking for them; ``prompt_positions``/``prompt_targets``: ``[P]`` step-token indices
    and the prompt token each predicts.
    """

    rows: torch.Tensor | None = None
    prompt_positions: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None


@dataclass
class Executed:
    """Tokens of one enqueued step, and its timeline if the executor has its own clock.

    ``tokens``: ``[S]`` int64 on the device, one per sampled position; ``accepted``: ``[V]`` int64 accepted drafts per
    verified row (None: none verified); ``nonfinite``: ``[S']`` bool, raw logits held NaN/inf (None: unchecked);
    ``done``: fires when tokens exist (simulated device only).
    """

    tokens: torch.Tensor
    accepted: torch.Tensor | None = None
    logprobs: LogprobTensors | None = None
    prompt_logprobs: LogprobTensors | None = None
    nonfinite: torch.Tensor | None = None
    done: SimEvent | None = None
    device_start_ns: int = 0
    device_end_ns: int = 0


def sample_tokens(logits: torch.Tensor, s: SamplingInputs) -> torch.Tensor:
    """``[S]`` int64 token ids, below ``V``, from the sampled rows' raw ``[S, V]`` float32 logits (left unchanged).

    Seeded noise is keyed by the sampled token's position, so a request draws the same noise in any batch. Defined for
    any logits, NaN and infinities included.
    """
    processed = s.processed_logits(logits)
    return sample_rows(processed, s.params, s.position)


def sample_and_verify(
    logits: torch.Tensor, s: SamplingInputs, v: VerifyInputs | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sample_tokens`` for the ``S'`` sampled positions (``logits`` ``[S', V]`` float32), then each verified row's
    accepted drafts (``v`` None: nothing verified; docs/design.md, "Speculative decoding").

    Returns ``(tokens [S'] int64, accepted [R] int64 or None)``: verified row ``r`` emits ``tokens[v.index[r, :
    accepted[r] + 1]]``; later positions are never emitted.
    """
    if v is None:
        return sample_tokens(logits, s), None
    processed = s.processed_logits(logits)
    tokens = processed.argmax(-1)
    rows, width = v.index.shape
    hot = None
    if s.params.plan.rows is not None:
        x = filtered_logits(processed, s.params)
        if v.draft_probs is not None:  # gathered before the race overwrites x
            hot = x.index_select(0, v.hot_index.view(-1)).view(v.hot_index.shape[0], width, -1)
        tokens.index_copy_(0, s.params.plan.rows, race(x, s.params.seed, s.position))
    targets = tokens.index_select(0, v.index.view(-1)).view(rows, width)
    accepted = accept_one_hot(targets, v.drafts)
    if hot is not None:
        hot_flat = v.index.index_select(0, v.hot_rows).view(-1)
        out, hot_accepted = rejection_sample(
            hot,
            v.draft_probs,
            v.drafts.index_select(0, v.hot_rows),
            targets.index_select(0, v.hot_rows),
            s.params.seed.index_select(0, v.hot_index[:, 0]),
            s.position.index_select(0, v.hot_index.view(-1)).view(-1, width),
        )
        accepted.index_copy_(0, v.hot_rows, hot_accepted)
        tokens.index_copy_(0, hot_flat, out.view(-1))
    return tokens, accepted


class Executor(ABC):
    """Forward and sample, given a step's resolved inputs and its metadata; ``vocab_size``/``max_positions`` None: no
    limit."""

    attn_backend: AttentionBackend
    vocab_size: int | None = None
    max_positions: int | None = None

    def build_metadata(
        self, layout: StepLayout, block_table: torch.Tensor, upload: Upload, shift: torch.Tensor | None = None
    ) -> AttentionMetadata:
        """The step's metadata for ``execute`` (``AttentionBackend.build_metadata``)."""
        return self.attn_backend.build_metadata(layout, block_table, upload, shift)

    @abstractmethod
    def execute(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata | GraphStep,
        last: torch.Tensor,
        sampling: SamplingInputs,
        logprobs: LogprobInputs,
        verify: VerifyInputs | None = None,
    ) -> Executed:
        """Enqueue the step's forward, sampling and log-probabilities; must not wait for the device.

        ``input_ids``: ``[T]`` int64 on the device; ``last``: ``[S]`` int64 step-token index of each sampled position
        (with drafts, a row's last ``1 + K`` tokens); ``verify``: rows whose drafts are verified, or None.
        """


class ModelExecutor(Executor):
    """The real model over a paged KV cache (``PAD_BLOCKS`` blocks beyond ``config.num_kv_blocks``) on ``device``.
    Steps with LoRA adapters (``lora``, with ``--enable-lora``) run eagerly, never as graphs.

    Raises:
        ValueError: ``config.max_model_len`` exceeds the model's ``max_position_embeddings`` (on CUDA a position past
            the RoPE table is an asynchronous device assert).
    """

    def __init__(self, config: EngineConfig, model, device: torch.device, dtype: torch.dtype):
        self.max_positions = int(model.config.max_position_embeddings)
        if config.max_model_len > self.max_positions:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.max_positions}; lower --max-model-len"
            )
        self.vocab_size = int(model.config.vocab_size)
        self.model = model
        self.attn_backend = model.attn_backend
        self.kv_caches = model.allocate_kv_caches(
            config.num_kv_blocks + PAD_BLOCKS, config.scheduler.block_size, dtype, device
        )
        self.block_size, self.pad_block = config.scheduler.block_size, config.num_kv_blocks
        self.graphs: DecodeGraphs | None = None
        self.lora = None

    @torch.inference_mode()
    def warm_up(self, upload: Upload) -> None:
        """Run one step (a 2-token prefill chunk beside a decode row, padding block only) so the first request pays no
        first-call costs."""
        cols = cdiv(2, self.block_size)
        layout = StepLayout.build([2, 1], [0, 1], [0, 1], self.block_size, cols)
        (table, input_ids) = upload([np.full((2, cols), self.pad_block), np.zeros(layout.num_tokens)])
        meta = self.attn_backend.build_metadata(layout, table, upload)
        hidden = self.model(input_ids, meta.positions, meta, self.kv_caches)
        self.model.compute_logits(hidden).argmax(-1).cpu()

    def capture_decode_graphs(self, block_table: torch.Tensor, sizes: Sequence[int]) -> DecodeGraphs:
        """Serve decode-only steps of up to ``max(sizes)`` rows through CUDA graphs (on CPU, eagerly); call once, after
        the block table exists.

        Raises:
            ValueError, NotImplementedError: as ``DecodeGraphs``.
        """
        self.graphs = DecodeGraphs(
            self.model, self.attn_backend, self.kv_caches, block_table, sizes, self.block_size, self.pad_block
        )
        if block_table.device.type == "cuda":
            self.graphs.capture()
        return self.graphs

    def build_metadata(
        self, layout: StepLayout, block_table: torch.Tensor, upload: Upload, shift: torch.Tensor | None = None
    ) -> AttentionMetadata | GraphStep:
        """A ``GraphStep`` for a decode-only step that fits a graph, else the backend's metadata."""
        eager = self.graphs is None or (self.lora is not None and self.lora.active)
        step = None if eager else self.graphs.prepare(layout, upload, shift)
        return step if step is not None else self.attn_backend.build_metadata(layout, block_table, upload, shift)

    def execute(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata | GraphStep,
        last: torch.Tensor,
        sampling: SamplingInputs,
        logprobs: LogprobInputs,
        verify: VerifyInputs | None = None,
    ) -> Executed:
        if isinstance(meta, GraphStep):  # a decode-only step (no prompt positions): its CUDA graph
            logits = meta.run(input_ids).index_select(0, last)
        else:
            hidden = self.model(input_ids, meta.positions, meta, self.kv_caches)
            logits = self.model.compute_logits(hidden.index_select(0, last))
        # Penalties and the sampler work on copies: `logits` stay raw for the log-probabilities below.
        tokens, accepted = sample_and_verify(logits, sampling, verify)
        # Such a row cannot be sampled (its argmax is token 0): its request ends with an error. A row's sum
        # is not finite exactly when a logit is not (or past 1e33 each, which no working model gives); one
        # reduction, 30x cheaper than isfinite().all() on the CPU, read with the tokens, never alone.
        executed = Executed(tokens=tokens, accepted=accepted, nonfinite=~torch.isfinite(logits.sum(-1)))
        if logprobs.rows is not None:
            executed.logprobs = token_logprobs(
                logits.index_select(0, logprobs.rows), tokens.index_select(0, logprobs.rows)
            )
        if logprobs.prompt_positions is not None:
            parts = []
            for i in range(0, logprobs.prompt_positions.shape[0], _PROMPT_LOGITS_ROWS):
                pos = logprobs.prompt_positions[i : i + _PROMPT_LOGITS_ROWS]
                parts.append(
                    token_logprobs(
                        self.model.compute_logits(hidden.index_select(0, pos)),
                        logprobs.prompt_targets[i : i + _PROMPT_LOGITS_ROWS],
                    )
                )
            executed.prompt_logprobs = parts[0] if len(parts) == 1 else tuple(torch.cat(p) for p in zip(*parts))
        return executed


class SimExecutor(Executor):
    """The simulated device: deterministic tokens, computed timeline (see ``.sim_device``; docs/design.md, "The
    simulated device").

    Sampling parameters, penalties and biases are ignored; log-probabilities are same-shape stand-ins
    (``sim_logprobs``); a constrained row draws the allowed token nearest its own (``nearest_allowed``).
    """

    def __init__(self, sim: SimulatedDevice, attn_backend: AttentionBackend | None = None):
        self.sim = sim
        self.attn_backend = attn_backend or default_backend()

    def execute(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        last: torch.Tensor,
        sampling: SamplingInputs,
        logprobs: LogprobInputs,
        verify: VerifyInputs | None = None,
    ) -> Executed:
        # Enqueued first: what follows is the simulated kernel's work, which a device does after the launch.
        start, end = self.sim.enqueue_step(input_ids.numel())
        # It reads the resolved inputs like the model would.
        last_ids, last_pos = input_ids[last].numpy(), meta.positions[last].numpy()
        tokens = torch.from_numpy(sim_next_tokens(last_ids, last_pos))
        if sampling.mask_rows is not None:  # the masks come after the step was enqueued, like a real draw's
            nearest_allowed(tokens, sampling.mask_rows, sampling.resolved_bitmask())
        executed = Executed(tokens=tokens, done=SimEvent(end), device_start_ns=start, device_end_ns=end)
        if verify is not None:
            executed.accepted = accept_one_hot(tokens[verify.index], verify.drafts)
        tokens = tokens.numpy()
        if logprobs.rows is not None:
            r = logprobs.rows.numpy()
            executed.logprobs = _as_tensors(sim_logprobs(last_ids[r], last_pos[r], tokens[r]))
        if logprobs.prompt_positions is not None:
            p = logprobs.prompt_positions.numpy()
            executed.prompt_logprobs = _as_tensors(
                sim_logprobs(input_ids[p].numpy(), meta.positions[p].numpy(), logprobs.prompt_targets.numpy())
            )
        return executed


def _as_tensors(arrays: tuple) -> LogprobTensors:
    return tuple(torch.from_numpy(a) for a in arrays)
