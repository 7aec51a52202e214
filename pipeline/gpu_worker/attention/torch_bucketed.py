"""The ``torch_bucketed`` attention backend: cost follows each request's own context (docs/design.md, "Attention
backends"): rows grouped into buckets of similar length (``plan_buckets``), one SDPA call each over their own blocks."""

from __future__ import annotations

import dataclasses

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
)
from pipeline.gpu_worker.attention.bucket_plan import MIN_PAD, MIN_QUERY_PAD, SLACK, plan_buckets
from pipeline.gpu_worker.attention.kv_layout import HEAD_MAJOR, TOKEN_MAJOR, finite, gather_blocks, write_kv
from pipeline.gpu_worker.attention.prefix_table import PrefixTable
from pipeline.gpu_worker.attention.torch_sdpa import GatherBuffer


@dataclasses.dataclass
class Bucket:
    """One SDPA call: rows of similar length, on the device (int64 index tensors unless noted).

    ``block_ids``: ``[rows, n_blocks]``, entries past a context point at block 0, masked; ``mask``: ``[rows, 1, q_max,
    n_blocks * block_size]`` bool; ``token_index``: ``[rows * q_max]`` (padding repeats a row's last token);
    ``out_rows``/``out_tokens``: ``[n]`` real queries (``out_rows`` None: all real); ``identity``: queries and output
    are plain reshapes; ``context_lens``/``query_lens``: ``[rows]``, decode only.
    """

    q_max: int
    block_ids: torch.Tensor
    mask: torch.Tensor
    token_index: torch.Tensor
    out_rows: torch.Tensor | None
    out_tokens: torch.Tensor
    identity: bool
    visible: torch.Tensor
    context_lens: torch.Tensor | None = None
    query_lens: torch.Tensor | None = None
    window_masks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def mask_for(self, window: int | None, prefix: PrefixTable) -> torch.Tensor:
        """The bucket's mask for a layer with this sliding window (None: causal): each query keeps its last ``window``
        keys."""
        if window is None:
            return self.mask
        if window not in self.window_masks:
            older = prefix.rows((self.visible - window).clamp_(min=0), self.mask.shape[-1])
            self.window_masks[window] = self.mask & ~older.view(self.mask.shape)
        return self.window_masks[window]


@dataclasses.dataclass
class BucketedMetadata(AttentionMetadata):
    """Per-step layout for ``TorchBucketedBackend``: ``decode`` (query_len <= ``decode_query_max``) and ``prefill``
    buckets, longest first."""

    decode: list[Bucket]
    prefill: list[Bucket]


def _block_ids(block_table: torch.Tensor, req_indices: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """``[rows, n_blocks]`` each row's first blocks, read on the device; entries past a context (a block id or -1) are
    clamped in bounds and masked."""
    # index_select of the sliced table, not block_table[req_indices, :n]: advanced indexing is 3x slower on CPU.
    return block_table[:, :n_blocks].index_select(0, req_indices).clamp_(min=0)


def _in_step_order(token_index: np.ndarray, num_tokens: int) -> bool:
    """Whether ``token_index`` is every token of the step, in order (a bucket that is the whole step)."""
    return token_index.size == num_tokens and bool((token_index == np.arange(num_tokens)).all())


def _bucket_bounds(plan: list[np.ndarray], row_blocks: np.ndarray) -> list[tuple[int, int, int]]:
    """Per bucket of ``plan``, laid out one after another: (first row, row count, blocks of its longest row);
    ``row_blocks`` ``[R]`` in that order."""
    bounds, first = [], 0
    for b in plan:
        bounds.append((first, b.size, int(row_blocks[first : first + b.size].max())))
        first += b.size
    return bounds


@dataclasses.dataclass
class _HostPrefill:
    """The host half of a prefill bucket: shapes and small index arrays (numpy int64)."""

    q_max: int
    n_blocks: int
    identity: bool
    padded: bool  # some queries are padding (out_rows needed)
    arrays: list[np.ndarray]  # req_indices, query_pos, token_index[, out_rows, out_tokens]


def _host_prefill(layout: StepLayout, rows: np.ndarray, shifted: bool) -> _HostPrefill:
    """Shapes and indices of the prefill bucket of requests ``rows`` (see ``Bucket``); with ``shifted`` also the rows,
    whose shift moves the bucket's positions on the device."""
    g = PaddedQueries.of(layout, rows)
    token_index = g.token_index.ravel()
    padded = not g.real.all()
    identity = not padded and _in_step_order(token_index, layout.num_tokens)
    arrays = [layout.req_indices[rows], g.query_pos, token_index]
    if padded:
        out_rows = np.flatnonzero(g.real)
        arrays += [out_rows, token_index[out_rows]]
    if shifted:
        arrays.append(rows)
    return _HostPrefill(g.q_max, g.n_blocks, identity, padded, arrays)


def _device_prefill(
    host: _HostPrefill,
    dev: list[torch.Tensor],
    block_table: torch.Tensor,
    block_size: int,
    prefix: PrefixTable,
    shift: torch.Tensor | None,
) -> Bucket:
    """A prefill bucket's block ids and causal mask, built on the device from its uploaded indices."""
    req_indices, query_pos, token_index = dev[:3]
    out_rows, out_tokens = dev[3:5] if host.padded else (None, token_index)
    if shift is not None:
        query_pos = query_pos - shift.index_select(0, dev[-1])[:, None]
    rows, q_max = query_pos.shape
    # Query at position p attends keys 0..p: the first p + 1.
    visible = (query_pos + 1).view(-1)
    mask = prefix.rows(visible, host.n_blocks * block_size).view(rows, 1, q_max, -1)
    return Bucket(
        q_max=host.q_max,
        block_ids=_block_ids(block_table, req_indices, host.n_blocks),
        mask=mask,
        token_index=token_index,
        out_rows=out_rows,
        out_tokens=out_tokens,
        identity=host.identity,
        visible=visible,
    )


@dataclasses.dataclass
class _HostDecode:
    """The host half of all decode buckets at once: rows ordered bucket by bucket (numpy int64)."""

    bounds: list[tuple[int, int, int]]  # per bucket: first row, row count, n_blocks
    identity: bool
    arrays: list[np.ndarray]  # req_indices [R], context_lens [R], token_index [R] (first query), query_lens [R]


def _host_decode(layout: StepLayout, rows: np.ndarray, plan: list[np.ndarray], shifted: bool) -> _HostDecode:
    """Every decode bucket's indices in four arrays (five ``shifted``: the rows too), so the build costs the same for 1
    bucket or 20."""
    order = rows[np.concatenate(plan)]
    query_lens = layout.query_lens[order]
    context_lens = layout.start_positions[order] + query_lens
    bounds = _bucket_bounds(plan, -(-context_lens // layout.block_size))
    token_index = layout.token_starts[order]
    identity = len(plan) == 1 and _in_step_order(token_index, layout.num_tokens)
    arrays = [layout.req_indices[order], context_lens, token_index, query_lens] + ([order] if shifted else [])
    return _HostDecode(bounds, identity, arrays)


def _device_decode(
    host: _HostDecode,
    dev: list[torch.Tensor],
    block_table: torch.Tensor,
    block_size: int,
    prefix: PrefixTable,
    shift: torch.Tensor | None,
) -> list[Bucket]:
    """Decode buckets as views of one block-id table and one mask built on the device."""
    req_indices, context_lens, token_index, query_lens = dev[:4]
    if shift is not None:
        context_lens = context_lens - shift.index_select(0, dev[4])
    n_blocks = host.bounds[0][2]  # plan_buckets puts the longest bucket first
    block_ids = _block_ids(block_table, req_indices, n_blocks)
    mask = prefix.rows(context_lens, n_blocks * block_size)[:, None, None, :]
    return [
        Bucket(
            q_max=1,
            block_ids=block_ids[a : a + n, :nb],
            mask=mask[a : a + n, ..., : nb * block_size],
            token_index=token_index[a : a + n],
            out_rows=None,
            out_tokens=token_index[a : a + n],
            identity=host.identity,
            visible=context_lens[a : a + n],
            context_lens=context_lens[a : a + n],
            query_lens=query_lens[a : a + n],
        )
        for a, n, nb in host.bounds
    ]


@dataclasses.dataclass
class _HostVerify:
    """The host half of the buckets of rows verifying drafts with ``q`` queries each (numpy int64)."""

    q: int
    bounds: list[tuple[int, int, int]]  # per bucket: first row, row count, n_blocks
    identity: bool
    arrays: list[np.ndarray]  # req_indices [R], query_pos [R, q], token_index [R * q][, rows]


def _host_verify(layout: StepLayout, rows: np.ndarray, plan: list[np.ndarray], q: int, shifted: bool) -> _HostVerify:
    """Every bucket of verifying rows of ``q`` queries in three arrays (four ``shifted``): with no padding to plan,
    their grids need no per-bucket build, unlike prefill chunks."""
    order = rows[np.concatenate(plan)]
    bounds = _bucket_bounds(plan, -(-(layout.start_positions[order] + q) // layout.block_size))
    offsets = np.arange(q)
    token_index = (layout.token_starts[order][:, None] + offsets).ravel()
    identity = len(plan) == 1 and _in_step_order(token_index, layout.num_tokens)
    query_pos = layout.start_positions[order][:, None] + offsets
    arrays = [layout.req_indices[order], query_pos, token_index] + ([order] if shifted else [])
    return _HostVerify(q, bounds, identity, arrays)


def _device_verify(
    host: _HostVerify,
    dev: list[torch.Tensor],
    block_table: torch.Tensor,
    block_size: int,
    prefix: PrefixTable,
    shift: torch.Tensor | None,
) -> list[Bucket]:
    """Verifying rows' buckets, their block ids views of one table built on the device; each bucket's causal mask is
    read at its own width (one mask at the widest would cost a long row's width for all)."""
    req_indices, query_pos, token_index = dev[:3]
    if shift is not None:
        query_pos = query_pos - shift.index_select(0, dev[3])[:, None]
    q, n_blocks = host.q, host.bounds[0][2]
    visible = (query_pos + 1).view(-1)
    block_ids = _block_ids(block_table, req_indices, n_blocks)
    return [
        Bucket(
            q_max=q,
            block_ids=block_ids[a : a + n, :nb],
            mask=prefix.rows(visible[a * q : (a + n) * q], nb * block_size).view(n, 1, q, nb * block_size),
            token_index=token_index[a * q : (a + n) * q],
            out_rows=None,
            out_tokens=token_index[a * q : (a + n) * q],
            identity=host.identity,
            visible=visible[a * q : (a + n) * q],
        )
        for a, n, nb in host.bounds
    ]


class TorchBucketedBackend(AttentionBackend):
    """SDPA per bucket of similar-length requests (see the module docstring); owns the shared ``GatherBuffer`` and
    ``PrefixTable``. ``decode_query_max`` is 1: a decode bucket's SDPA call folds one query's heads."""

    name = "torch_bucketed"
    decode_query_max = 1

    def __init__(
        self, head_major: bool = True, slack: float = SLACK, min_pad: int = MIN_PAD, min_query_pad: int = MIN_QUERY_PAD
    ) -> None:
        self.cache_layout = HEAD_MAJOR if head_major else TOKEN_MAJOR
        self.limits = (slack, min_pad, min_query_pad)
        self.workspace = GatherBuffer()
        self.prefix = PrefixTable()

    def build_metadata(
        self, layout: StepLayout, block_table: torch.Tensor, upload: Upload, shift: torch.Tensor | None = None
    ) -> BucketedMetadata:
        q_lens = layout.query_lens
        ctx = layout.start_positions + q_lens
        # A decode row, or one verifying its drafts (up to decode_query_max queries); a prefill chunk,
        # however short, stays on SDPA, so a cached prompt's tail computes as the whole prompt would.
        verifies = q_lens - layout.num_draft_tokens == 1
        is_decode = verifies & (q_lens <= self.decode_query_max)
        shifted = shift is not None
        rows = np.flatnonzero(is_decode)
        decode = _host_decode(layout, rows, self.plan_decode(ctx[rows]), shifted) if rows.size else None
        # The other verifying rows: one grid per query count (a step's drafting rows mostly share one).
        verify = []
        rows = np.flatnonzero(verifies & ~is_decode)
        if rows.size:
            q_rows = q_lens[rows]
            for q in [int(q_rows[0])] if q_rows.min() == q_rows.max() else np.unique(q_rows).tolist():
                rows_q = rows[q_rows == q]
                verify.append(_host_verify(layout, rows_q, self.plan_decode(ctx[rows_q]), q, shifted))
        rows = np.flatnonzero(~verifies)
        prefill = [
            _host_prefill(layout, rows[b], shifted)
            for b in (plan_buckets(ctx[rows], q_lens[rows], *self.limits) if rows.size else [])
        ]
        # One upload for the whole step: positions, slot-mapping inputs, decode buckets, prefill buckets.
        arrays = layout.shifted_inputs(shifted)
        i = len(arrays)
        arrays += decode.arrays if decode is not None else []
        for h in verify + prefill:
            arrays += h.arrays
        dev = upload(arrays)
        positions, token_req_indices, token_cols = shifted_slots(dev, shift, layout.block_size)
        decode_buckets = []
        if decode is not None:
            n = len(decode.arrays)
            decode_buckets = _device_decode(decode, dev[i : i + n], block_table, layout.block_size, self.prefix, shift)
            i += n
        prefill_buckets = []
        for h in verify:
            n = len(h.arrays)
            prefill_buckets += _device_verify(h, dev[i : i + n], block_table, layout.block_size, self.prefix, shift)
            i += n
        for h in prefill:
            prefill_buckets.append(
                _device_prefill(h, dev[i : i + len(h.arrays)], block_table, layout.block_size, self.prefix, shift)
            )
            i += len(h.arrays)
        return BucketedMetadata(
            num_tokens=layout.num_tokens,
            block_size=layout.block_size,
            positions=positions,
            slot_mapping=slot_mapping(block_table, token_req_indices, token_cols, positions, layout.block_size),
            decode=decode_buckets,
            prefill=prefill_buckets,
        )

    def plan_decode(self, context_lens: np.ndarray) -> list[np.ndarray]:
        """Buckets of the step's decode rows, given their ``[R]`` contexts (see ``plan_buckets``)."""
        return plan_buckets(context_lens, np.ones_like(context_lens), *self.limits)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: BucketedMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = write_kv(kv_cache, finite(k), finite(v), meta.slot_mapping, self.cache_layout)
        buckets = meta.decode + meta.prefill
        out = None if len(buckets) == 1 and buckets[0].identity else q.new_empty(q.shape)
        for b in buckets:
            res = self.attend_bucket(q, k_cache, v_cache, b, meta.block_size, scale, window, softcap)
            if out is None:
                return res
            out.index_copy_(0, b.out_tokens, res)
        return out

    def attend_bucket(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        b: Bucket,
        block_size: int,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """One bucket's SDPA call over its gathered blocks (``window``, ``softcap`` as ``AttentionBackend.forward``);
        returns ``[len(b.out_tokens), H, D]`` in ``b.out_tokens`` order."""
        num_heads, head_dim = q.shape[1:]
        kv_heads = k_cache.shape[0] if self.cache_layout == HEAD_MAJOR else k_cache.shape[1]
        rows, n_blocks = b.block_ids.shape
        numel = rows * n_blocks * block_size * kv_heads * head_dim
        scratch = self.workspace.get(2 * numel, k_cache.dtype, k_cache.device)
        keys = gather_blocks(k_cache, b.block_ids, block_size, self.cache_layout, scratch[:numel])
        values = gather_blocks(v_cache, b.block_ids, block_size, self.cache_layout, scratch[numel:])
        q_b = q if b.identity else q.index_select(0, b.token_index)
        mask = b.mask_for(window, self.prefix)
        if b.q_max == 1:
            # One query per row: fold the heads sharing a KV head into the
            # query dimension, so K/V are never expanded.
            return sdpa(
                q_b.reshape(rows, kv_heads, num_heads // kv_heads, head_dim), keys, values, mask, scale, softcap
            ).view(rows, num_heads, head_dim)
        res = (
            sdpa(
                q_b.reshape(rows, b.q_max, num_heads, head_dim).transpose(1, 2),
                keys,
                values,
                mask,
                scale,
                softcap,
                enable_gqa=True,
            )
            .transpose(1, 2)
            .reshape(rows * b.q_max, num_heads, head_dim)
        )
        return res if b.out_rows is None else res.index_select(0, b.out_rows)
