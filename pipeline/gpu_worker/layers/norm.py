"""RMSNorm as Llama computes it, and as Gemma does: ``x̂ (1 + w)`` in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.gpu_worker.layers.linear import empty_parameter, load_whole


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, times a learned scale ``w``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(dim)
        self.weight.weight_loader = load_whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., dim]`` -> same shape and dtype."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: normalised and scaled by ``1 + w`` in float32, then cast back.

    Llama casts to the input dtype before the scale, Gemma after it (transformers PR #29402); in bfloat16 the two round
    differently.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def make_norm(kind: str, dim: int, eps: float) -> RMSNorm:
    """``kind`` "rms" (Llama's) or "gemma"."""
    return GemmaRMSNorm(dim, eps) if kind == "gemma" else RMSNorm(dim, eps)
