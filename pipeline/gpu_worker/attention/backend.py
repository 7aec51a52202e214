"""The attention-backend interface: per-step metadata, per-layer forward.

A step's tokens are one flat batch, request after request (docs/design.md,
"The worker"). The runner asks the backend once per step for its metadata
(:meth:`AttentionBackend.build_metadata`); every layer of the model then
calls :meth:`AttentionBackend.forward` with its own queries, keys, values and
KV cache and that same metadata. Whatever the backend precomputes (gather
indices, masks, kernel plans) lives in its metadata subclass, so a new
backend is a new module here, not an edit of the model or the runner.

Cache layout, shared by every backend: per layer ``k_cache`` and ``v_cache``
are ``[num_blocks * block_size, num_kv_heads, head_dim]``; token position
``p`` of a request whose block table is ``bt`` lives at flat index
``bt[p // block_size] * block_size + p % block_size``.

This module also holds what every paged backend computes the same way: input
checks, and each token's position and KV-cache slot.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod

import torch

# One layer's (k_cache, v_cache).
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class AttentionMetadata:
    """Fields every backend's per-step metadata has; backends subclass it.

    Attributes:
        num_tokens: T, the number of tokens in the step.
        block_size: tokens per KV cache block.
        positions: ``[T]`` int64, position of each token in its sequence
            (the model's RoPE index).
        slot_mapping: ``[T]`` int64, flat KV cache index each token's key and
            value are written to.
    """

    num_tokens: int
    block_size: int
    positions: torch.Tensor
    slot_mapping: torch.Tensor


class AttentionBackend(ABC):
    """Paged attention for one model: metadata once per step, forward per layer.

    A backend instance belongs to one model and may keep scratch memory
    shared by its layers (layers run one after another, in stream order).
    """

    name: str = "abstract"

    @abstractmethod
    def build_metadata(
        self,
        query_lens: torch.Tensor,
        start_positions: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Lay out one step.

        Request ``i`` owns step tokens ``[cu[i], cu[i] + query_lens[i])``
        where ``cu`` is the exclusive cumulative sum of ``query_lens``; their
        positions are ``start_positions[i] + 0 .. query_lens[i] - 1``.

        Args:
            query_lens: ``[B]`` int64 host tensor, tokens scheduled per request, each >= 1.
            start_positions: ``[B]`` int64 host tensor, position of each
                request's first scheduled token (= tokens already in its KV cache).
            block_table: ``[B, max_blocks_per_seq]`` int32/int64 host tensor,
                each request's block-table row; entries past a request's
                context are ignored and may hold anything.
            block_size: tokens per KV cache block.
            device: where the metadata's tensors must live.

        Raises:
            ValueError: on inconsistent shapes, an empty batch, a query_len < 1,
                a negative start position, or a context that does not fit the
                block table.
        """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's keys and values into ``kv_cache``, then attend.

        Each token attends to itself and to every earlier position of its
        own sequence (earlier steps' keys come from the cache).

        Args:
            q: ``[T, H, D]`` queries (RoPE applied).
            k: ``[T, KVH, D]`` keys (RoPE applied), H a multiple of KVH.
            v: ``[T, KVH, D]`` values.
            kv_cache: the layer's ``(k_cache, v_cache)``, written in place.
            meta: this step's metadata from :meth:`build_metadata`.
            scale: softmax scale, usually ``D ** -0.5``.

        Returns:
            ``[T, H, D]`` attention output, dtype of ``q``.
        """


def check_step_inputs(
    query_lens: torch.Tensor, start_positions: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate a step's layout inputs (see :meth:`AttentionBackend.build_metadata`).

    Reads the values on the host: pass host tensors.

    Returns:
        ``(query_lens, start_positions, block_table)`` as int64.

    Raises:
        ValueError: as :meth:`AttentionBackend.build_metadata`.
    """
    if query_lens.dim() != 1 or query_lens.numel() == 0:
        raise ValueError(f"query_lens must be a non-empty 1-D tensor, got shape {tuple(query_lens.shape)}")
    num_reqs = query_lens.numel()
    if start_positions.shape != (num_reqs,):
        raise ValueError(f"start_positions must have shape ({num_reqs},), got {tuple(start_positions.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(
            f"block_table must have shape ({num_reqs}, max_blocks_per_seq), got {tuple(block_table.shape)}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    query_lens = query_lens.long()
    start_positions = start_positions.long()
    block_table = block_table.long()
    if bool((query_lens < 1).any()):
        raise ValueError(f"every query_len must be >= 1, got {query_lens.tolist()}")
    if bool((start_positions < 0).any()):
        raise ValueError(f"start positions must be >= 0, got {start_positions.tolist()}")
    context_lens = start_positions + query_lens
    max_context = block_table.shape[1] * block_size
    if int(context_lens.max()) > max_context:
        raise ValueError(
            f"a context of {int(context_lens.max())} tokens does not fit a block table of "
            f"{block_table.shape[1]} blocks of {block_size}"
        )
    return query_lens, start_positions, block_table


def token_layout(
    query_lens: torch.Tensor, start_positions: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Each token's position and KV-cache slot.

    Args:
        query_lens, start_positions: ``[B]`` int64 (checked by :func:`check_step_inputs`).
        block_table: ``[B, max_blocks_per_seq]`` int64.
        block_size: tokens per KV cache block.

    Returns:
        ``(token_starts [B], positions [T], slot_mapping [T], T)``, int64
        tensors on the inputs' device; ``token_starts`` is the exclusive
        cumulative sum of ``query_lens``.
    """
    device = query_lens.device
    num_reqs = query_lens.numel()
    token_starts = torch.cumsum(query_lens, 0) - query_lens
    num_tokens = int(query_lens.sum())
    request_of_token = torch.repeat_interleave(torch.arange(num_reqs, device=device), query_lens)
    offsets = torch.arange(num_tokens, device=device) - token_starts[request_of_token]
    positions = start_positions[request_of_token] + offsets
    block_of_token = block_table[request_of_token, positions // block_size]
    slot_mapping = block_of_token * block_size + positions % block_size
    return token_starts, positions, slot_mapping, num_tokens
