"""Per-slot state the worker keeps on the device, updated in stream order.

A request keeps one slot while it runs (docs/design.md, "The step
protocol"). For each slot the device holds the last sampled token (the
token-id cache), the block-table row, and the sampling parameters. Updates
come from the descriptor: new block-table entries every step, parameters
only on a request's first step in its slot. They are enqueued
on the compute stream before the step that reads them, so a step already
queued never sees a later step's update, and no update waits for the device.

The sampling parameters are also mirrored on the host. The host copy decides
how to sample (which rows are greedy, how many top-k candidates, whether
top-p runs); the device copy is what the kernels read. Neither is ever read
back from the device.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.common.step_protocol import StepInputs
from pipeline.gpu_worker.device import DeviceOps

# Written into a token-id cache entry once a placeholder consumed it; reading
# it again means a placeholder resolved to a stale token.
POISON_TOKEN_ID = -7


class SlotState:
    """Token-id cache, block table and sampling parameters of ``num_slots`` slots.

    Device tensors (on ``ops.device``): ``token_cache [slots]`` int64 (starts
    at :data:`POISON_TOKEN_ID`), ``block_table [slots, max_blocks_per_seq]``
    int64, ``temperature``/``top_p [slots]`` float32, ``top_k``/``seed
    [slots]`` int64. Host mirrors (numpy): ``host_temperature``,
    ``host_top_p``, ``host_top_k``; host only: ``host_logprobs [slots]``
    int64, alternatives wanted per sampled token, -1 for no log-probabilities
    (the worker computes all ``MAX_LOGPROBS``; io_proc keeps what was asked).
    """

    def __init__(self, num_slots: int, max_blocks_per_seq: int, ops: DeviceOps):
        self.ops = ops
        device = ops.device
        self.token_cache = torch.full((num_slots,), POISON_TOKEN_ID, dtype=torch.int64, device=device)
        self.block_table = torch.zeros((num_slots, max_blocks_per_seq), dtype=torch.int64, device=device)
        self.temperature = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.seed = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.host_temperature = np.zeros(num_slots, dtype=np.float32)
        self.host_top_p = np.ones(num_slots, dtype=np.float32)
        self.host_top_k = np.zeros(num_slots, dtype=np.int64)
        self.host_logprobs = np.full(num_slots, -1, dtype=np.int64)

    def apply(self, x: StepInputs) -> None:
        """Enqueue step ``x``'s block-table entries and its new rows' sampling parameters."""
        if x.new_blocks.shape[1]:
            slot, index, block = x.new_blocks
            width = self.block_table.shape[1]
            flat_index, block_ids = self.ops.upload([slot * width + index, block])
            self.block_table.view(-1).index_copy_(0, flat_index, block_ids)
        if len(x.new_rows):
            slots = x.slot[x.new_rows]
            slots_d, top_k_d, seed_d = self.ops.upload([slots, x.top_k, x.seed])
            temperature_d, top_p_d = self.ops.upload([x.temperature, x.top_p], np.float32)
            self.temperature.index_copy_(0, slots_d, temperature_d)
            self.top_p.index_copy_(0, slots_d, top_p_d)
            self.top_k.index_copy_(0, slots_d, top_k_d)
            self.seed.index_copy_(0, slots_d, seed_d)
            self.host_temperature[slots], self.host_top_p[slots] = x.temperature, x.top_p
            self.host_top_k[slots] = x.top_k
            self.host_logprobs[slots] = x.logprobs
