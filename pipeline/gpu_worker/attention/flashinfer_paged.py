"""The ``flashinfer`` attention backend (CUDA): FlashInfer's paged-KV batch prefill kernel, one call per layer for the
whole step, no gather or padding (docs/design.md, "Attention backends", "The in-flight limit").

Chosen over flash-attn, whose paged KV needs pages of 256 tokens. ``plan`` reads pinned host index arrays; two planned
wrappers alternate. float16/bfloat16, head sizes 64, 128, 256; the first step may JIT-compile (minutes).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline.gpu_worker.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    StepLayout,
    Upload,
    slot_mapping,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# FlashInfer's recommended float workspace (split-KV partial results); shared by both wrappers.
WORKSPACE_BYTES = 128 * 1024 * 1024


def unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the flashinfer backend cannot serve this model here (``head_dim`` in elements), or None if it can."""
    if device.type != "cuda":
        return f"it runs on CUDA only, not {device.type}"
    if dtype not in SUPPORTED_DTYPES:
        return f"it has no {dtype} kernels (float16 and bfloat16 only)"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {SUPPORTED_HEAD_DIMS}"
    if importlib.util.find_spec("flashinfer") is None:
        return "the flashinfer package is not installed (pip install flashinfer-python)"
    return None


@dataclasses.dataclass
class FlashInferMetadata(AttentionMetadata):
    """Per-step metadata for ``FlashInferBackend``: ``wrappers``, per ``(window, softcap)`` of the model's layers,
    planned for this step."""

    wrappers: dict[tuple[int | None, float | None], Any]


def _pinned_int32(a: np.ndarray) -> torch.Tensor:
    """``a`` as an int32 tensor in page-locked host memory (what ``plan`` reads on the host)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).pin_memory()


class FlashInferBackend(AttentionBackend):
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` over the paged cache (see the module docstring).

    ``scale`` is planned per step, so ``forward`` must be given the same; each ``kinds`` pair plans as ``window_left =
    window - 1`` and ``logits_soft_cap``.

    Raises:
        ValueError: if ``unsupported_reason`` finds a reason.
    """

    name = "flashinfer"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scale: float | None = None,
        kinds: Sequence[tuple[int | None, float | None]] = ((None, None),),
    ) -> None:
        reason = unsupported_reason(device, dtype, head_dim)
        if reason is not None:
            raise ValueError(f"attention backend flashinfer: {reason}")
        import flashinfer

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.scale = head_dim**-0.5 if scale is None else scale
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers = {
            kind: [flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD") for _ in range(2)]
            for kind in dict.fromkeys(kinds)
        }
        self._turn = 0

    def build_metadata(
        self, layout: StepLayout, block_table: torch.Tensor, upload: Upload, shift: torch.Tensor | None = None
    ) -> FlashInferMetadata:
        if shift is not None:
            # plan() takes every row's exact KV length on the host.
            raise ValueError(
                "flashinfer plans from exact host context lengths, which speculative decoding with "
                "asynchronous scheduling does not have: use --attention-backend torch_bucketed"
            )
        q_lens, starts, bs = layout.query_lens, layout.start_positions, layout.block_size
        context_lens = starts + q_lens
        pages = -(-context_lens // bs)
        qo_indptr = np.concatenate(([0], np.cumsum(q_lens)))
        kv_indptr = np.concatenate(([0], np.cumsum(pages)))
        last_page_len = (context_lens - 1) % bs + 1
        # Each request's pages, in order: its first ``pages`` block-table
        # entries, read on the device (the table lives there).
        page_rows = np.repeat(layout.req_indices, pages)
        page_cols = np.arange(int(kv_indptr[-1])) - np.repeat(kv_indptr[:-1], pages)
        positions, token_req_indices, token_cols, page_rows_d, page_cols_d = upload(
            [layout.positions, *layout.slot_mapping_inputs(), page_rows, page_cols]
        )
        kv_indices = block_table[page_rows_d, page_cols_d].to(torch.int32)

        host = [_pinned_int32(qo_indptr), _pinned_int32(kv_indptr), kv_indices, _pinned_int32(last_page_len)]
        planned = {}
        for (window, softcap), turns in self._wrappers.items():
            planned[window, softcap] = wrapper = turns[self._turn]
            wrapper.plan(
                *host,
                num_qo_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim_qk=self.head_dim,
                page_size=bs,
                causal=True,
                sm_scale=self.scale,
                window_left=-1 if window is None else window - 1,
                logits_soft_cap=softcap,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
                non_blocking=True,
            )
        self._turn ^= 1
        return FlashInferMetadata(
            num_tokens=layout.num_tokens,
            block_size=bs,
            positions=positions,
            slot_mapping=slot_mapping(block_table, token_req_indices, token_cols, positions, bs),
            wrappers=planned,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: FlashInferMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if scale != self.scale:
            raise ValueError(f"flashinfer planned softmax scale {self.scale}, forward got {scale}")
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        pages = k_cache.shape[0] // meta.block_size
        shape = (pages, meta.block_size, k_cache.shape[1], k_cache.shape[2])
        return meta.wrappers[window, softcap].run(q.contiguous(), (k_cache.view(shape), v_cache.view(shape)))
