"""Drafts from a smaller model with the target's vocabulary (docs/design.md, "Speculative decoding").

Its own paged KV cache shares the target's block table and slots (``consume`` runs it over every step's inputs);
``propose`` runs ``k`` one-token passes per verifying row, sampled rows handing ``q`` to ``rejection_sample``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.common.config import EngineConfig
from pipeline.gpu_worker.attention.backend import StepLayout
from pipeline.gpu_worker.cuda_graphs import GraphStep
from pipeline.gpu_worker.device import DeviceOps, Staged, UploadBatch
from pipeline.gpu_worker.executor import PAD_BLOCKS
from pipeline.gpu_worker.input_batch import InputBatch
from pipeline.gpu_worker.sampling.rejection_sampler import DRAFT_SALT
from pipeline.gpu_worker.sampling.sampler import filtered_logits, race

if TYPE_CHECKING:  # the simulated device never loads the model code
    from pipeline.gpu_worker.models.base import CausalLM


@dataclass
class DraftPlan:
    """One step's draft passes, decided on the host: its ``V`` verified rows and ``k``.

    ``rows``/``req``/``start``/``first [V]``: descriptor row, req_index, host position (an upper bound when shifted) and
    step-token index of each row's first input; ``hot [H]``: rows that sample, ``hot_req`` their req_indices.
    """

    k: int
    req: np.ndarray
    start: np.ndarray
    rows: Staged
    first: Staged
    hot: Staged | None = None
    hot_req: Staged | None = None
    host_hot_req: np.ndarray | None = None


class DraftModel:
    """The draft model, its KV cache and its passes; ``consume`` reuses ``target``'s metadata when backend and head
    shapes match (None: never).

    Raises:
        ValueError: the draft's vocabulary size differs from the target's.
    """

    keeps_history = False

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        device: torch.device,
        input_batch: InputBatch,
        ops: DeviceOps,
        target: CausalLM | None = None,
    ):
        if target is not None and target.config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({model.config.vocab_size} tokens) differs from the target's "
                f"({target.config.vocab_size})"
            )
        self.model, self.input_batch, self.upload = model, input_batch, ops.upload
        dtype = getattr(torch, config.dtype)
        self.kv_caches = model.allocate_kv_caches(
            config.num_kv_blocks + PAD_BLOCKS, config.scheduler.block_size, dtype, device
        )
        self.block_size, self.max_blocks = config.scheduler.block_size, config.max_blocks_per_seq
        self.host_reads_ok = not ops.is_async  # as the target's sampling plan

        def shape(m: CausalLM) -> tuple:
            return type(m.attn_backend), m.num_heads, m.num_kv_heads, m.head_dim, m.attention_kinds

        self.shares_metadata = target is not None and shape(target) == shape(model)

    def stage(
        self, k: int, req: np.ndarray, start: np.ndarray, rows: np.ndarray, first: np.ndarray, batch: UploadBatch
    ) -> DraftPlan:
        """Stage a step's draft passes for the verified rows at descriptor ``rows`` (``[V]``; see ``DraftPlan``)."""
        plan = DraftPlan(k, req, start, batch.add(rows), batch.add(first))
        ib = self.input_batch
        hot = np.flatnonzero(ib.host_temperature[req] > 0) if ib.any_hot else ()
        if len(hot):
            plan.hot, plan.hot_req, plan.host_hot_req = batch.add(hot), batch.add(req[hot]), req[hot]
        return plan

    def propose(
        self, plan: DraftPlan, input_ids: torch.Tensor, shift: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(drafts [V, k] int64, q [H, k, V_vocab] float32 or None)``: the plan's rows' drafts and the sampled rows'
        draft distributions; ``shift``: ``[B]`` per descriptor row (None: exact)."""
        n = len(plan.req)
        cur = input_ids.index_select(0, plan.first.dev)
        row_shift = shift.index_select(0, plan.rows.dev) if shift is not None else None
        ib, vocab = self.input_batch, self.model.config.vocab_size
        sampling = None
        if plan.hot is not None:
            sampling = ib.sampling_tensors(plan.hot.dev, plan.host_hot_req, plan.hot_req.dev, vocab, self.host_reads_ok)
            seeds = sampling.seed ^ DRAFT_SALT
        drafts, qs = [], []
        ones = np.ones(n, np.int64)
        for j in range(plan.k):
            layout = StepLayout.build(ones, plan.start + j, plan.req, self.block_size, self.max_blocks)
            meta = self.model.attn_backend.build_metadata(layout, ib.block_table, self.upload, row_shift)
            logits = self.model.compute_logits(self.model(cur, meta.positions, meta, self.kv_caches))
            cur = logits.argmax(-1)
            if sampling is not None:
                x = filtered_logits(logits, sampling)
                qs.append(torch.softmax(x, dim=-1))
                # Keyed by the drafted token's position, as the target's draw there (with its own salt).
                cur.index_copy_(0, plan.hot.dev, race(x, seeds, meta.positions.index_select(0, plan.hot.dev) + 1))
            drafts.append(cur)
        return torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None

    def consume(self, input_ids: torch.Tensor, meta, layout: StepLayout, shift: torch.Tensor | None) -> None:
        """Run the draft over a step's ``[T]`` inputs at the target's slots (``meta``: the target's metadata)."""
        if not self.shares_metadata or isinstance(meta, GraphStep):
            meta = self.model.attn_backend.build_metadata(layout, self.input_batch.block_table, self.upload, shift)
        self.model(input_ids, meta.positions, meta, self.kv_caches)
