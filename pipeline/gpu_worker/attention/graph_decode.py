"""The attention of decode graphs, whatever the model's backend: each row attends its whole block-table row
(docs/design.md, "CUDA graphs").

Static per-row buffers (req_index, position, context length) are filled before each replay; block ids, slots and mask
are derived on the device. Padding rows (req_index -1) use only the padding block.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pipeline.gpu_worker.attention.backend import (
    AttentionImpl,
    AttentionMetadata,
    StepLayout,
    Upload,
    sdpa,
    window_mask,
)
from pipeline.gpu_worker.attention.kv_layout import KVCache, finite, gather_blocks, write_kv


@dataclasses.dataclass
class GraphDecodeMetadata(AttentionMetadata):
    """What the layers see inside a decode graph of ``n = num_tokens`` rows, on the device: ``block_ids`` ``[n,
    max_blocks_per_seq]`` int64 (padding block past a context), ``mask`` ``[n, 1, 1, max_blocks_per_seq * block_size]``.
    """

    block_ids: torch.Tensor
    mask: torch.Tensor
    window_masks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The rows' mask for a layer with this sliding window (None: their whole context)."""
        if window is None:
            return self.mask
        if window not in self.window_masks:
            self.window_masks[window] = window_mask(self.mask, self.positions[:, None], window)
        return self.window_masks[window]


class GraphDecodeInputs:
    """The static buffers decode graphs read at fixed addresses: ``rows`` (req_index, position, context length) ``[3,
    max_rows]`` int64 and ``slot_mapping [max_rows]``; ``block_table`` is read at its address."""

    def __init__(self, max_rows: int, block_table: torch.Tensor, pad_block: int, block_size: int) -> None:
        self.block_table, self.pad_block, self.block_size = block_table, pad_block, block_size
        device = block_table.device
        self.rows = torch.empty((3, max_rows), dtype=torch.int64, device=device)
        self.rows[0].fill_(-1)  # every row starts as a padding row
        self.rows[1].fill_(0)
        self.rows[2].fill_(1)
        self.slot_mapping = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def fill(self, layout: StepLayout, size: int, upload: Upload, shift: torch.Tensor | None = None) -> torch.Tensor:
        """Write a decode-only step's rows, padded to ``size``, with one upload and one device copy (and one subtraction
        with a ``shift``); returns the rows' positions."""
        num_rows = layout.query_lens.size
        host = np.empty((3, size), dtype=np.int64)
        host[:, num_rows:] = [[-1], [0], [1]]
        host[0, :num_rows] = layout.req_indices
        host[1, :num_rows] = layout.start_positions
        host[2, :num_rows] = layout.start_positions + 1
        self.rows[:, :size].copy_(upload([host])[0])
        if shift is not None:
            self.rows[1:, :num_rows] -= shift
        return self.rows[1, :num_rows]

    def metadata(self, size: int) -> GraphDecodeMetadata:
        """The graph's metadata for ``size`` rows, computed on the device from the buffers (inside the graph)."""
        req_indices, positions, context_lens = self.rows[:, :size]
        bs = self.block_size
        max_blocks = self.block_table.shape[1]
        device = self.block_table.device
        cols = torch.arange(max_blocks, device=device)
        # Block-table entries past a row's context may hold anything: the padding block replaces them.
        used = (req_indices >= 0)[:, None] & (cols[None, :] * bs < context_lens[:, None])
        block_ids = torch.where(used, self.block_table[req_indices.clamp(min=0)], self.pad_block)
        column = (positions // bs)[:, None]
        torch.add(block_ids.gather(1, column).squeeze(1) * bs, positions % bs, out=self.slot_mapping[:size])
        key_pos = torch.arange(max_blocks * bs, device=device)
        return GraphDecodeMetadata(
            num_tokens=size,
            block_size=bs,
            positions=positions,
            slot_mapping=self.slot_mapping[:size],
            block_ids=block_ids,
            mask=(key_pos[None, :] < context_lens[:, None])[:, None, None, :],
        )


class GraphDecodeAttention(AttentionImpl):
    """The attention of captured decode steps: ``DecodeGraphs`` passes it to the model in place of the model's backend;
    its metadata comes from ``GraphDecodeInputs.metadata``, inside the graph; the cache is in ``cache_layout``."""

    name = "graph_decode"

    def __init__(self, cache_layout: str) -> None:
        self.cache_layout = cache_layout

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: GraphDecodeMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Decode attention with the graph's fixed shapes: write K/V at ``meta.slot_mapping``, gather every row's
        blocks, one SDPA call (``q [n, H, D]``)."""
        k_cache, v_cache = write_kv(kv_cache, finite(k), finite(v), meta.slot_mapping, self.cache_layout)
        rows, num_heads, head_dim = q.shape
        kv_heads = k.shape[1]
        numel = meta.block_ids.numel() * meta.block_size * kv_heads * head_dim
        layout = self.cache_layout
        keys = gather_blocks(k_cache, meta.block_ids, meta.block_size, layout, k_cache.new_empty(numel))
        values = gather_blocks(v_cache, meta.block_ids, meta.block_size, layout, v_cache.new_empty(numel))
        # The heads sharing a KV head fold into the query dimension, so K/V are never expanded.
        return sdpa(
            q.reshape(rows, kv_heads, num_heads // kv_heads, head_dim),
            keys,
            values,
            meta.mask_for(window),
            scale,
            softcap,
        ).reshape(rows, num_heads, head_dim)
