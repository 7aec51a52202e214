"""A checked PEFT adapter's tensors in host memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.common.lora_checkpoint import LoraWeights, load_weights, read_weights
from pipeline.common.model_config import ModelConfig


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter in host memory.

    Attributes:
        weights: ``(layer, projection) -> (A [r, in], B [out, r] times scaling)``, float32.
    """

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @staticmethod
    def of(w: LoraWeights) -> LoraAdapter:
        """``w``'s arrays as tensors (shared, not copied)."""
        return LoraAdapter({k: (torch.from_numpy(a), torch.from_numpy(b)) for k, (a, b) in w.weights.items()})


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """The PEFT adapter in directory ``path`` for a base model of ``config``, checked and read.

    Raises:
        LoraError: as ``lora_checkpoint.read_weights``.
    """
    return LoraAdapter.of(read_weights(path, config, max_rank))


def load_prepared(file: str | Path) -> LoraAdapter:
    """The prepared copy in ``file`` (``lora_checkpoint.save_weights``).

    Raises:
        OSError, ValueError: the file is gone or damaged.
    """
    return LoraAdapter.of(load_weights(file))
