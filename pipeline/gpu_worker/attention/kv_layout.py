"""How a backend uses the KV cache's memory (docs/design.md, "Attention backends"): ``[num_blocks * block_size, KVH,
D]`` as allocated (``TOKEN_MAJOR``) or viewed ``[KVH, slots, D]`` (``HEAD_MAJOR``, faster CPU SDPA reads)."""

from __future__ import annotations

import torch

# One layer's (k_cache, v_cache).
KVCache = tuple[torch.Tensor, torch.Tensor]

TOKEN_MAJOR = "token_major"
HEAD_MAJOR = "head_major"


def finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN and infinities as 0: masked gathers read unwritten slots, and 0 x NaN is NaN (docs/design.md,
    "Non-finite logits")."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def write_kv(kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, layout: str) -> KVCache:
    """Write ``k``/``v`` (``[T, KVH, D]``) at ``slot_mapping`` (``[T]`` int64) into one layer's cache; returns the cache
    in ``layout`` (``[KVH, slots, D]`` views if ``HEAD_MAJOR``)."""
    k_cache, v_cache = kv_cache
    if layout == HEAD_MAJOR:
        kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache = k_cache.view(kv_heads, -1, head_dim)
        v_cache = v_cache.view(kv_heads, -1, head_dim)
        k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))
    else:
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, v)
    return k_cache, v_cache


def gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, block_size: int, layout: str, out: torch.Tensor
) -> torch.Tensor:
    """Gather each row's blocks (``block_ids``: ``[rows, n_blocks]`` int64) of one cache into ``out`` (contiguous, the
    cache's dtype), as a ``[rows, KVH, n_blocks * block_size, D]`` view."""
    rows, n_blocks = block_ids.shape
    flat = block_ids.flatten()
    if layout == HEAD_MAJOR:
        kv_heads, _, head_dim = cache.shape
        g = torch.index_select(
            cache.view(kv_heads, -1, block_size, head_dim),
            1,
            flat,
            out=out.view(kv_heads, rows * n_blocks, block_size, head_dim),
        )
        return g.view(kv_heads, rows, n_blocks * block_size, head_dim).transpose(0, 1)
    _, kv_heads, head_dim = cache.shape
    g = torch.index_select(
        cache.view(-1, block_size, kv_heads, head_dim),
        0,
        flat,
        out=out.view(rows * n_blocks, block_size, kv_heads, head_dim),
    )
    return g.view(rows, n_blocks * block_size, kv_heads, head_dim).transpose(1, 2)
