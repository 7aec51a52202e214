"""The gated MLP: ``down(act(gate(x)) * up(x))``, gate and up in one matmul."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.gpu_worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pipeline.gpu_worker.layers.tp import SINGLE_RANK, TPGroup

# transformers' ACT2FN names; gelu_new is the same tanh approximation as gelu_pytorch_tanh.
ACTIVATION_FNS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


class GatedMLP(nn.Module):
    """SwiGLU (``act`` "silu") or GeGLU (a gelu) MLP; column-parallel gate/up and row-parallel down.

    Args:
        hidden_size, intermediate_size: the full model's widths.
        act: a key of ``ACTIVATION_FNS``.
        bias: whether the projections have biases.
        tp: this rank's group; each rank holds ``intermediate_size / N`` of it.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool, tp: TPGroup = SINGLE_RANK):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)
        self.intermediate = intermediate_size // tp.size
        self.act = ACTIVATION_FNS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate = self.act(gate_up[:, : self.intermediate])
        return self.down_proj(gate.mul_(gate_up[:, self.intermediate :]))
