"""A checked PEFT adapter's tensors in host memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.common.lora_checkpoint import LoraError, check_adapter
from pipeline.common.model_config import ModelConfig
from pipeline.gpu_worker.models.loader import iter_tensors


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter in host memory.

    Attributes:
        rank: its ``r``.
        weights: ``(layer, projection) -> (A [r, in], B [out, r] times scaling)``, float32.
    """

    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """The PEFT adapter in directory ``path`` for a base model of ``config``, checked (``check_adapter``).

    Raises:
        LoraError: as ``check_adapter``, or a tensor holding NaN or infinities.
    """
    spec = check_adapter(path, config, max_rank)
    names = {name: key for key, name in spec.tensors.items()}
    parts = {}
    try:
        for name, tensor in iter_tensors(spec.tensors_path):
            parts[names[name]] = tensor.to(torch.float32, copy=True)
    except ValueError as e:  # a NaN (CheckpointError)
        raise LoraError(str(e)) from None
    weights = {(i, p): (parts[i, p, "A"], parts[i, p, "B"] * spec.scaling) for i, p, w in parts if w == "A"}
    return LoraAdapter(spec.rank, weights)
