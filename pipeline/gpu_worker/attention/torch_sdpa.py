"""The ``torch_sdpa`` attention backend: padded groups over ``scaled_dot_product_attention``.

Attention cost must stay O(batch x context) (docs/design.md, "Attention backends"): one mask spanning every request's
tokens would be O(tokens^2). So the step's requests are split into two groups, each attended with one batched call:

- decode rows (query_len == 1): queries ``[Bd, H, 1, D]`` (run as
  ``[Bd, KVH, H / KVH, D]``) against each row's own keys, padded to the
  longest context among decode rows;
- prefill rows (query_len > 1): queries padded to the longest chunk among the
  prefill rows only, ``[Bp, H, Qmax, D]``, with a causal mask.

Keys and values are gathered block by block through each row's block table (cache layout in ``kv_layout``, token-major
here). Everything shaped by the batch is computed once per step in ``TorchSDPABackend.build_metadata``: small index
arrays on the host, masks and block ids on the device; the per-layer path only indexes precomputed tensors, so it has no
Python loop over requests and no host synchronisation.
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
    """Precomputed indices for one batched attention call (decode or prefill), on the device.

    Attributes:
        token_index: ``[rows, q_max]`` int64, index into the step's tokens of each query; padded query positions repeat
            the row's last token so that their mask row is non-empty (no NaN from an all-masked softmax).
        block_ids: ``[rows, n_blocks]`` int64 KV block ids to gather; entries beyond a row's context point at block 0
            and are masked out.
        mask: ``[rows, 1, q_max, n_blocks * block_size]`` bool, True where a query may attend a key (key_pos <=
            query_pos, hence also key_pos < context_len).
        out_rows: ``[n_tokens]`` int64, index into the flattened ``[rows * q_max]`` queries of each real (unpadded)
            query.
        out_tokens: ``[n_tokens]`` int64, step-token index of each of them.
        identity: True when the group holds every token of the step in order with no padding, so queries and outputs are
            plain reshapes.
        query_pos: ``[rows, q_max]`` int64, each query's position.
        window_masks: ``mask`` narrowed to each sliding window used this step (``key_pos > query_pos - window``), made
            by the first layer that asks.
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
    """Per-step layout for ``TorchSDPABackend``, shared by every layer.

    Attributes (beyond ``AttentionMetadata``): decode: group of requests with query_len == 1, or None if there are none.
        prefill: group of requests with query_len > 1, or None if there are none.
    """

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
    """Grow-only scratch memory for gathered keys and values.

    On CPU a fresh multi-megabyte tensor per layer is served by glibc with mmap and page-faulted in on every use:
    measured here, that doubled a batch-64 decode step. Reusing one buffer across layers and steps avoids it. Users run
    sequentially (one layer at a time, in stream order on CUDA).
    """

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
    """Gather each row's keys and values as ``[rows, KVH, n_blocks * block_size, D]`` views.

    Whole blocks are gathered (block_size times fewer indices than per-token).
    """
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
    """Write this step's keys and values into the cache, then attend.

    The write comes first so each token attends to itself and to earlier chunks of its own sequence.

    Args:
        q: ``[T, H, D]`` queries (RoPE applied).
        k: ``[T, KVH, D]`` keys (RoPE applied), H a multiple of KVH.
        v: ``[T, KVH, D]`` values.
        k_cache: ``[num_blocks * block_size, KVH, D]``, written in place.
        v_cache: same shape, written in place.
        meta: the step's metadata, on the same device as the tensors.
        scale: softmax scale, usually ``D ** -0.5``.
        workspace: scratch for the gathered keys/values, shared by all layers; None allocates per call (fine on CUDA,
            slow on CPU).
        window, softcap: as ``AttentionBackend.forward``.

    Returns:
        ``[T, H, D]`` attention output, dtype of ``q``.
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
    """Padded decode and prefill groups over SDPA (see the module docstring).

    Owns the ``GatherBuffer`` its layers share.
    """

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
