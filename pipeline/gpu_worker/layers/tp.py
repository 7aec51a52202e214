"""This rank's place in its tensor-parallel group: what the sharded layers need for their collectives."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """A rank of a tensor-parallel group (docs/design.md, "Parallelism"); ``group`` None where no collective runs."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place; returns ``t``."""
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` on each rank -> ``[..., N * d]``, rank 0's columns first."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE_RANK = TPGroup()
