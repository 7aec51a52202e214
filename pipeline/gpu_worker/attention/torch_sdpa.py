"""The ``torch_sdpa`` attention backend: padded groups over ``scaled_dot_product_attention`` (docs/design.md, "Attention
backends").

Decode rows (``[Bd, KVH, H / KVH, D]``) and prefill rows (``[Bp, H, Qmax, D]``, causal mask) are each one batched call
over gathered blocks; ``build_metadata`` precomputes every index, so layers have no Python loop or host sync.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from pipeline.gpu_worker.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    PaddedQueries,
    StepLayout,
    Upload,
    sdpa,
    shifted_slots,
    slot_mapping,
    window_mask,
)
from pipeline.gpu_worker.attention.kv_layout import finite


@dataclasses.dataclass
class AttentionGroup:
    """Precomputed int64 indices for one batched attention call, on the device.

    ``token_index``/``query_pos``: ``[rows, q_max]`` (padding repeats a row's last token: no all-masked softmax);
    ``block_ids``: ``[rows, n_blocks]`` (past a context: block 0, masked); ``mask``: ``[rows, 1, q_max, n_blocks *
    block_size]`` bool; ``out_rows``/``out_tokens``: ``[n_tokens]`` real queries; ``identity``: plain reshapes.
    """

    token_index: torch.Tensor
    block_ids: torch.Tensor
    mask: torch.Tensor
    out_rows: torch.Tensor
    out_tokens: torch.Tensor
    identity: bool
    query_pos: torch.Tensor
    window_masks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The group's mask for a layer with this sliding window (None: the causal mask)."""
        if window is None:
            return self.mask
        if window not in self.window_masks:
            self.window_masks[window] = window_mask(self.mask, self.query_pos, window)
        return self.window_masks[window]


@dataclasses.dataclass
class SDPAMetadata(AttentionMetadata):
    """Per-step layout for ``TorchSDPABackend``: ``decode`` (query_len == 1) and ``prefill`` groups, None when empty."""

    decode: AttentionGroup | None
    prefill: AttentionGroup | None


@dataclasses.dataclass
class _HostGroup:
    """The host half of one group: shapes and small index arrays (numpy int64)."""

    q_max: int
    n_blocks: int
    identity: bool
    arrays: list[np.ndarray]  # req_indices [rows], context_lens [rows], token_index, query_pos, out_rows, out_tokens


def _host_group(layout: StepLayout, rows: np.ndarray, shifted: bool) -> _HostGroup:
    """Shapes and indices of the padded group of requests ``rows`` (see ``AttentionGroup``); with ``shifted`` also the
    rows, whose shift moves the group's positions on the device."""
    g = PaddedQueries.of(layout, rows)
    out_rows = np.flatnonzero(g.real)
    out_tokens = g.token_index.ravel()[out_rows]
    identity = rows.size == layout.query_lens.size and out_rows.size == rows.size * g.q_max == layout.num_tokens
    arrays = [layout.req_indices[rows], g.context_lens, g.token_index, g.query_pos, out_rows, out_tokens]
    return _HostGroup(g.q_max, g.n_blocks, identity, arrays + ([rows] if shifted else []))


def _device_group(
    host: _HostGroup, dev: list[torch.Tensor], block_table: torch.Tensor, block_size: int, shift: torch.Tensor | None
) -> AttentionGroup:
    """Block ids and mask of one group, built on the device from its uploaded indices."""
    req_indices, context_lens, token_index, query_pos, out_rows, out_tokens = dev[:6]
    if shift is not None:
        row_shift = shift.index_select(0, dev[6])
        context_lens, query_pos = context_lens - row_shift, query_pos - row_shift[:, None]
    device = block_table.device
    # Unused block-table entries may be garbage (e.g. -1); point them at
    # block 0 so the gather stays in bounds, the mask hides them.
    block_cols = torch.arange(host.n_blocks, device=device)
    needed = block_cols[None, :] * block_size < context_lens[:, None]
    block_ids = torch.where(needed, block_table[req_indices, : host.n_blocks], 0)
    key_pos = torch.arange(host.n_blocks * block_size, device=device)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)
    return AttentionGroup(
        token_index=token_index,
        block_ids=block_ids,
        mask=mask,
        out_rows=out_rows,
        out_tokens=out_tokens,
        identity=host.identity,
        query_pos=query_pos,
    )


class GatherBuffer:
    """Grow-only scratch for gathered keys and values, reused across layers and steps (a fresh tensor per layer is
    mmapped and page-faulted on CPU); users run sequentially."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous 1-D tensor of ``numel`` elements; its content is undefined."""
        buf = self._buffer
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            # A normal tensor, not an inference tensor: it stays writable if
            # a later step runs outside torch.inference_mode.
            with torch.inference_mode(False):
                buf = self._buffer = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


def _gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    block_size: int,
    workspace: GatherBuffer | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each row's keys and values, whole blocks, as ``[rows, KVH, n_blocks * block_size, D]`` views."""
    _, kv_heads, head_dim = k_cache.shape
    rows, n_blocks = block_ids.shape
    flat_ids = block_ids.flatten()
    shape = (rows * n_blocks, block_size, kv_heads, head_dim)
    numel = math.prod(shape)
    out = None if workspace is None else workspace.get(2 * numel, k_cache.dtype, k_cache.device)
    gathered = []
    for i, cache in enumerate((k_cache, v_cache)):
        blocks = cache.view(-1, block_size, kv_heads, head_dim)
        if out is None:
            g = blocks.index_select(0, flat_ids)
        else:
            g = torch.index_select(blocks, 0, flat_ids, out=out[i * numel : (i + 1) * numel].view(shape))
        gathered.append(g.view(rows, n_blocks * block_size, kv_heads, head_dim).transpose(1, 2))
    return gathered[0], gathered[1]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: SDPAMetadata,
    scale: float,
    workspace: GatherBuffer | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's keys and values into the caches (``[num_blocks * block_size, KVH, D]``) in place, then attend.

    Shapes and ``window``/``softcap`` as ``AttentionBackend.forward``; ``workspace`` None allocates per call (slow on
    CPU).
    """
    k_cache.index_copy_(0, meta.slot_mapping, finite(k))
    v_cache.index_copy_(0, meta.slot_mapping, finite(v))

    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group_size = num_heads // kv_heads
    out = None if _single_identity_group(meta) else q.new_empty(num_tokens, num_heads, head_dim)

    dec = meta.decode
    if dec is not None:
        rows = dec.token_index.shape[0]
        keys, values = _gather_kv(k_cache, v_cache, dec.block_ids, meta.block_size, workspace)
        q_dec = q if dec.identity else q.index_select(0, dec.out_tokens)
        # One query per row: fold the heads sharing a KV head into the query
        # dimension. Unlike enable_gqa, this never expands K/V (enable_gqa was
        # up to 7x slower for bfloat16 decode on CPU).
        res = sdpa(
            q_dec.reshape(rows, kv_heads, group_size, head_dim), keys, values, dec.mask_for(window), scale, softcap
        ).reshape(rows, num_heads, head_dim)
        if out is None:
            return res
        out.index_copy_(0, dec.out_tokens, res)

    pre = meta.prefill
    if pre is not None:
        rows, q_max = pre.token_index.shape
        keys, values = _gather_kv(k_cache, v_cache, pre.block_ids, meta.block_size, workspace)
        if pre.identity:
            q_pre = q.reshape(rows, q_max, num_heads, head_dim)
        else:
            q_pre = q.index_select(0, pre.token_index.flatten()).view(rows, q_max, num_heads, head_dim)
        res = sdpa(
            q_pre.transpose(1, 2), keys, values, pre.mask_for(window), scale, softcap, enable_gqa=True
        ).transpose(1, 2)
        if out is None:
            return res.reshape(num_tokens, num_heads, head_dim)
        res = res.reshape(rows * q_max, num_heads, head_dim)
        out.index_copy_(0, pre.out_tokens, res.index_select(0, pre.out_rows))
    return out


def _single_identity_group(meta: SDPAMetadata) -> bool:
    """True when one group covers the whole step in order, so its output is the result."""
    group = meta.decode if meta.prefill is None else meta.prefill if meta.decode is None else None
    return group is not None and group.identity


class TorchSDPABackend(AttentionBackend):
    """Padded decode and prefill groups over SDPA (see the module docstring); owns its layers' ``GatherBuffer``."""

    name = "torch_sdpa"

    def __init__(self) -> None:
        self.workspace = GatherBuffer()

    def build_metadata(
        self, layout: StepLayout, block_table: torch.Tensor, upload: Upload, shift: torch.Tensor | None = None
    ) -> SDPAMetadata:
        is_decode = layout.query_lens == 1
        shifted = shift is not None
        hosts = [
            _host_group(layout, rows, shifted) if rows.size else None
            for rows in (np.flatnonzero(is_decode), np.flatnonzero(~is_decode))
        ]
        # One upload for the whole step: positions, slot-mapping inputs, then each group's arrays.
        arrays = layout.shifted_inputs(shifted)
        i = len(arrays)
        for h in hosts:
            arrays += h.arrays if h is not None else []
        dev = upload(arrays)
        positions, token_req_indices, token_cols = shifted_slots(dev, shift, layout.block_size)
        groups = []
        for h in hosts:
            if h is None:
                groups.append(None)
                continue
            groups.append(_device_group(h, dev[i : i + len(h.arrays)], block_table, layout.block_size, shift))
            i += len(h.arrays)
        return SDPAMetadata(
            num_tokens=layout.num_tokens,
            block_size=layout.block_size,
            positions=positions,
            slot_mapping=slot_mapping(block_table, token_req_indices, token_cols, positions, layout.block_size),
            decode=groups[0],
            prefill=groups[1],
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: SDPAMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, scale, self.workspace, window, softcap)
