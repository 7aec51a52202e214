"""The tensor-parallel process group of one engine's worker ranks.

Each rank is one gpu_worker process with one device. The ranks meet over a
private rendezvous: a ``file://`` store in the instance's socket directory,
which only this user can reach and which needs no free port
(docs/design.md, "Parallelism"). The collectives run on gloo for CPU
tensors and NCCL for CUDA ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline.common.config import EngineConfig
from pipeline.gpu_worker.parallel import TPGroup


def init_tensor_parallel(config: EngineConfig, rank: int) -> TPGroup:
    """Join the engine's process group as ``rank``; returns once every rank has joined.

    On CUDA, the rank takes device ``config.device_index(rank)``.

    Raises:
        RuntimeError: the rendezvous or the backend failed (from torch.distributed).
    """
    backend = "gloo"
    if config.device == "cuda":
        torch.cuda.set_device(config.device_index(rank))
        backend = "nccl"
    dist.init_process_group(backend, init_method=config.tp_init_method, rank=rank,
                            world_size=config.tensor_parallel_size)
    return TPGroup(rank, config.tensor_parallel_size, dist.group.WORLD)
