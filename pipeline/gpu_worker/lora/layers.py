"""The batched LoRA update around the base model's projections, adapters in fixed slots.

Each wrapped projection keeps the stacked weights of every slot: ``lora_a``
``[slots, P R, in]`` and ``lora_b`` ``[slots, R, out]`` (B transposed), where
a fused projection of P parts (q/k/v, gate/up) gives each part its own R rank
rows of A (``R = --max-lora-rank``; an adapter of lower rank leaves the rest
zero), and part p's output columns of B are that part's B (so B holds no
zeros between parts). Slot 0 is "no adapter" and stays zero. A step runs the
base matmul once for all its tokens; then its tokens with an adapter,
gathered in slot order, take their low-rank update a slot at a time (SGMV's
grouping: ``t = x_s @ A_s.T``, then part p's columns ``t_p @ B_s[:, p]`` over
each slot's run of tokens, at most ``--max-loras`` runs, never a loop over
rows), which is added back at their rows (docs/design.md, "Multi-LoRA").
Under tensor parallelism a column-parallel projection holds its rows of B,
a row-parallel one its columns of A and sums its partial update over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipeline.gpu_worker.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pipeline.gpu_worker.layers.tp import TPGroup
from pipeline.gpu_worker.lora.adapter import LoraAdapter


class LoraBatch:
    """Which slot each token of the current step uses, shared by every LoRA layer of a model.

    Attributes:
        slots: ``(slot, start, end)`` per slot the step uses: its tokens are ``tokens[start:end]``;
            None when no token has an adapter.
        tokens: ``[N]`` int64, the step's tokens that have an adapter, in slot order (stable).
    """

    def __init__(self) -> None:
        self.slots: list[tuple[int, int, int]] | None = None
        self.tokens: torch.Tensor | None = None

    def set_rows(self, row_slots: np.ndarray, num_tokens: np.ndarray, device) -> None:
        """The step's rows: ``row_slots [R]`` (0: none) over ``num_tokens [R]`` tokens each (host arrays)."""
        if not row_slots.any():
            self.slots = self.tokens = None
            return
        token_slots = np.repeat(row_slots, num_tokens)
        tokens = np.flatnonzero(token_slots)
        tokens = tokens[np.argsort(token_slots[tokens], kind="stable")]
        used, starts, counts = np.unique(token_slots[tokens], return_index=True, return_counts=True)
        self.slots = [(int(s), int(a), int(a + n)) for s, a, n in zip(used, starts, counts, strict=True)]
        self.tokens = torch.from_numpy(tokens).to(device)


@dataclass(frozen=True)
class _Part:
    """One projection of a wrapped layer: its output rows here, and which rows of B and columns of A are
    this rank's."""

    projection: str
    out_rows: slice
    b_rows: slice
    a_cols: slice


class LoraLinear(nn.Module):
    """``base(x)`` plus each token's adapter update (see the module docstring)."""

    def __init__(
        self,
        base: LinearBase,
        parts: list[_Part],
        in_features: int,
        out_features: int,
        batch: LoraBatch,
        num_slots: int,
        max_rank: int,
        reduce: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.base, self.parts, self.batch, self.rank, self.reduce = base, parts, batch, max_rank, reduce
        dtype, device = torch.get_default_dtype(), base.weight.device
        width = len(parts) * max_rank
        self.register_buffer("lora_a", torch.zeros(num_slots, width, in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(num_slots, max_rank, out_features, dtype=dtype, device=device))
        # Each part's rank columns of x A.T and its output columns: the update of a fused projection is one
        # matmul a part (B's zeros outside a part's columns were a third of a slot's bytes for SmolLM2).
        self.spans = [(slice(i * max_rank, (i + 1) * max_rank), part.out_rows) for i, part in enumerate(parts)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.slots is None:
            return y
        tokens = self.batch.tokens
        xs = x.index_select(0, tokens)
        delta = xs.new_empty(len(tokens), y.shape[1])
        for slot, start, end in self.batch.slots:
            t = torch.mm(xs[start:end], self.lora_a[slot].T)
            if len(self.spans) == 1:
                torch.mm(t, self.lora_b[slot], out=delta[start:end])
                continue
            for rank_cols, out_cols in self.spans:
                delta[start:end, out_cols] = torch.mm(t[:, rank_cols], self.lora_b[slot, :, out_cols])
        if self.reduce is not None:
            delta = self.reduce.all_reduce(delta)
        return y.index_add_(0, tokens, delta)

    def load(self, slot: int, layer: int, adapter: LoraAdapter | None) -> None:
        """Put ``adapter``'s weights of decoder layer ``layer`` into ``slot`` (None: clear it)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if adapter is None:
            return
        for i, part in enumerate(self.parts):
            ab = adapter.weights.get((layer, part.projection))
            if ab is None:
                continue
            a, b = ab
            self.lora_a[slot, i * self.rank : i * self.rank + a.shape[0]] = a[:, part.a_cols]
            self.lora_b[slot, : a.shape[0], part.out_rows] = b[part.b_rows].T


class LoraSlots:
    """A model's adapter slots: wraps its projections at construction, then loads adapters and sets steps.

    Args:
        model: a loaded ``CausalLM`` (its weights may be packed).
        max_loras: slots 1 .. max_loras hold adapters (slot 0: none).
        max_rank: the largest adapter rank.
    """

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.batch = LoraBatch()
        self.layers: list[tuple[int, LoraLinear]] = []
        n = max_loras + 1
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = self._wrap(i, _qkv(attn.qkv_proj), attn.qkv_proj, n, max_rank)
            attn.o_proj = self._wrap(i, _row(attn.o_proj, "o_proj"), attn.o_proj, n, max_rank)
            if hasattr(mlp, "gate_up_proj"):  # a dense MLP (experts take no adapter)
                mlp.gate_up_proj = self._wrap(i, _merged(mlp.gate_up_proj), mlp.gate_up_proj, n, max_rank)
                mlp.down_proj = self._wrap(i, _row(mlp.down_proj, "down_proj"), mlp.down_proj, n, max_rank)

    def _wrap(self, layer: int, spec, base: LinearBase, num_slots: int, max_rank: int) -> LoraLinear:
        parts, in_features, out_features, reduce = spec
        wrapped = LoraLinear(base, parts, in_features, out_features, self.batch, num_slots, max_rank, reduce)
        self.layers.append((layer, wrapped))
        return wrapped

    @torch.no_grad()
    def load(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Put ``adapter`` into ``slot`` (>= 1) of every wrapped projection (None: clear the slot)."""
        for layer, wrapped in self.layers:
            wrapped.load(slot, layer, adapter)


def _qkv(layer: QKVParallelLinear):
    parts = [
        _Part(f"{sid}_proj", slice(dst, dst + n), slice(src, src + n), slice(None))
        for sid, (n, dst, src) in layer.layout.items()
    ]
    out = sum(n for n, _, _ in layer.layout.values())
    return parts, layer.weight.shape[1], out, None


def _merged(layer: MergedColumnParallelLinear):
    parts, dst = [], 0
    for name, n in zip(("gate_proj", "up_proj"), layer.local_sizes, strict=True):
        src = layer.tp.rank * n
        parts.append(_Part(name, slice(dst, dst + n), slice(src, src + n), slice(None)))
        dst += n
    return parts, layer.weight.shape[1], dst, None


def _row(layer: RowParallelLinear, name: str):
    n = layer.in_features // layer.tp.size
    out = layer.weight.shape[0]
    cols = slice(layer.tp.rank * n, (layer.tp.rank + 1) * n)
    return [_Part(name, slice(None), slice(None), cols)], n, out, layer.tp if layer.tp.size > 1 else None
