"""The attention-backend interface: per-step metadata, per-layer forward (docs/design.md, "Attention backends").

Host-decided shapes (``StepLayout``) are uploaded at once; a per-row ``shift`` moves positions back after rejected
drafts (docs/design.md, "Speculative decoding").
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.gpu_worker.attention.kv_layout import TOKEN_MAJOR, KVCache

# Copies int64 host arrays to the device in one non-blocking transfer; returns them in order.
Upload = Callable[[Sequence[np.ndarray]], list[torch.Tensor]]


def window_mask(mask: torch.Tensor, query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` (``[rows, 1, Q, K]`` bool) narrowed to a sliding window: key position ``k`` stays for the query at
    ``query_pos`` (``[rows, Q]``) when ``k > query_pos - window``, as transformers masks."""
    key_pos = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (key_pos > query_pos[..., None] - window).unsqueeze(1)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` over ``[B, H, Q, D]`` queries and ``[B, KVH, K, D]`` keys; with ``softcap``,
    runs transformers' eager path instead (matmul, cap, mask, float32 softmax, matmul), as SDPA cannot cap scores."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(q.dtype), v)


def host_upload(arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """``Upload`` for a CPU "device": int64 tensors over the arrays."""
    return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]


@dataclasses.dataclass
class StepLayout:
    """One step's token layout on the host (numpy int64): request ``i`` owns step tokens ``token_starts[i] + [0,
    query_lens[i])`` at positions ``start_positions[i] + [0, query_lens[i])``.

    ``[B]`` per request: ``query_lens`` (>= 1), ``start_positions`` (tokens already cached), ``req_indices``
    (block-table row), ``num_draft_tokens`` (0 unless verifying drafts), ``token_starts``; ``[T]`` per token:
    ``request_of_token``, ``positions``.
    """

    query_lens: np.ndarray
    start_positions: np.ndarray
    req_indices: np.ndarray
    num_draft_tokens: np.ndarray
    block_size: int
    token_starts: np.ndarray
    request_of_token: np.ndarray
    positions: np.ndarray
    num_tokens: int

    @classmethod
    def build(
        cls, query_lens, start_positions, req_indices, block_size: int, max_blocks_per_seq: int, num_draft_tokens=None
    ) -> StepLayout:
        """Check and lay out a step; ``num_draft_tokens`` None means no drafts.

        Raises:
            ValueError: inconsistent shapes, an empty batch, a query_len < 1, a negative start position, or a context
                wider than a block-table row.
        """
        q = np.asarray(query_lens, dtype=np.int64)
        s = np.asarray(start_positions, dtype=np.int64)
        if q.ndim != 1 or q.size == 0:
            raise ValueError(f"query_lens must be a non-empty 1-D array, got shape {q.shape}")
        if s.shape != q.shape:
            raise ValueError(f"start_positions must have shape ({q.size},), got {s.shape}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if (q < 1).any():
            raise ValueError(f"every query_len must be >= 1, got {q.tolist()}")
        if (s < 0).any():
            raise ValueError(f"start positions must be >= 0, got {s.tolist()}")
        d = np.zeros_like(q) if num_draft_tokens is None else np.asarray(num_draft_tokens, dtype=np.int64)
        if d.shape != q.shape or (d < 0).any() or (d >= q).any():
            raise ValueError(f"num_draft_tokens must be [{q.size}] integers in 0 .. query_len - 1, got {d.tolist()}")
        longest = int((s + q).max())
        if longest > max_blocks_per_seq * block_size:
            raise ValueError(
                f"a context of {longest} tokens does not fit a block table of "
                f"{max_blocks_per_seq} blocks of {block_size}"
            )
        token_starts = np.cumsum(q) - q
        num_tokens = int(q.sum())
        request_of_token = np.repeat(np.arange(q.size), q)
        positions = s[request_of_token] + np.arange(num_tokens) - token_starts[request_of_token]
        return cls(
            query_lens=q,
            start_positions=s,
            req_indices=np.asarray(req_indices, dtype=np.int64),
            num_draft_tokens=d,
            block_size=block_size,
            token_starts=token_starts,
            request_of_token=request_of_token,
            positions=positions,
            num_tokens=num_tokens,
        )

    def slot_mapping_inputs(self) -> list[np.ndarray]:
        """``[req_index of each token, block column of each token]`` for ``slot_mapping``."""
        return [self.req_indices[self.request_of_token], self.positions // self.block_size]

    def shifted_inputs(self, shifted: bool) -> list[np.ndarray]:
        """``[positions, *slot_mapping_inputs()]``, plus ``request_of_token`` when ``shifted``: what ``shifted_slots``
        reads."""
        return [self.positions, *self.slot_mapping_inputs()] + ([self.request_of_token] if shifted else [])


@dataclasses.dataclass(frozen=True)
class PaddedQueries:
    """Requests ``rows`` of a step as a ``[R, q_max]`` grid of queries (int64 ``token_index``, ``query_pos``), for
    backends that pad rows; ``real`` (``[R * q_max]`` bool) marks real queries, ``context_lens`` (``[R]``) tokens
    attended.

    Padded queries repeat the row's last real query (a valid index, a non-empty mask row); their output is dropped.
    """

    q_max: int
    n_blocks: int
    context_lens: np.ndarray
    token_index: np.ndarray
    query_pos: np.ndarray
    real: np.ndarray

    @classmethod
    def of(cls, layout: StepLayout, rows: np.ndarray) -> PaddedQueries:
        """The grid of ``layout``'s requests ``rows`` (host arrays)."""
        q_lens = layout.query_lens[rows]
        starts = layout.start_positions[rows]
        context_lens = starts + q_lens
        q_max = int(q_lens.max())
        q_offsets = np.minimum(np.arange(q_max)[None, :], (q_lens - 1)[:, None])
        return cls(
            q_max=q_max,
            n_blocks=-(-int(context_lens.max()) // layout.block_size),
            context_lens=context_lens,
            token_index=layout.token_starts[rows][:, None] + q_offsets,
            query_pos=starts[:, None] + q_offsets,
            real=(np.arange(q_max)[None, :] < q_lens[:, None]).ravel(),
        )


def shifted_slots(
    layout_dev: list[torch.Tensor], shift: torch.Tensor | None, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positions, token_req_indices, token_cols)`` of the step's tokens on the device, moved back by ``shift``
    (``[B]`` int64; None: exact); ``layout_dev`` holds the device copies of ``StepLayout.shifted_inputs``."""
    positions, token_req_indices, token_cols = layout_dev[:3]
    if shift is None:
        return positions, token_req_indices, token_cols
    positions = positions - shift.index_select(0, layout_dev[3])
    return positions, token_req_indices, torch.div(positions, block_size, rounding_mode="floor")


def slot_mapping(
    block_table: torch.Tensor,
    token_req_indices: torch.Tensor,
    token_cols: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``[T]`` int64 flat KV-cache slot of each token on the device (inputs from ``StepLayout.slot_mapping_inputs``)."""
    return block_table[token_req_indices, token_cols] * block_size + positions % block_size


@dataclasses.dataclass
class AttentionMetadata:
    """Fields every backend's per-step metadata has: ``positions`` (RoPE index) and ``slot_mapping`` (KV write index),
    ``[T]`` int64 on the device."""

    num_tokens: int
    block_size: int
    positions: torch.Tensor
    slot_mapping: torch.Tensor


class AttentionImpl(ABC):
    """A layer's paged attention over a step's metadata (vLLM's name for a backend's per-layer half).

    ``cache_layout`` is ``kv_layout.TOKEN_MAJOR`` or ``HEAD_MAJOR``.
    """

    name: str = "abstract"
    cache_layout: str = TOKEN_MAJOR

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write this step's keys and values into ``kv_cache`` in place, then attend causally (or to the last ``window``
        keys, the query's own included, as transformers masks).

        ``q``: ``[T, H, D]``, ``k``/``v``: ``[T, KVH, D]`` (RoPE applied, H a multiple of KVH). ``softcap``: scores
        become ``softcap * tanh(s / softcap)`` before mask and softmax (Gemma 2). Returns ``[T, H, D]`` in ``q``'s
        dtype.
        """


class AttentionBackend(AttentionImpl):
    """Paged attention for one model: metadata once per step, forward per layer; may keep scratch memory its layers
    share."""

    @abstractmethod
    def build_metadata(
        self, layout: StepLayout, block_table: torch.Tensor, upload: Upload, shift: torch.Tensor | None = None
    ) -> AttentionMetadata:
        """Lay out one step on the device without waiting for it.

        ``block_table`` (``[rows, max_blocks_per_seq]`` int64 on the device): request ``i`` uses row
        ``layout.req_indices[i]``; entries past its context may hold anything. ``shift`` (``[B]`` int64 on the device):
        row ``i`` starts ``shift[i]`` positions before ``layout.start_positions[i]`` (its rejected drafts); None: exact.

        Raises:
            ValueError: a ``shift`` for a backend that needs exact host positions.
        """

    def build_from_rows(
        self, query_lens, start_positions, block_table: torch.Tensor, block_size: int, num_draft_tokens=None
    ) -> AttentionMetadata:
        """``build_metadata`` with one block-table row per request, for CPU tensors (tests, benchmarks).

        Raises:
            ValueError: as ``StepLayout.build``, or a block table whose rows do not match.
        """
        num_reqs = len(query_lens)
        if block_table.dim() != 2 or block_table.shape[0] != num_reqs:
            raise ValueError(
                f"block_table must have shape ({num_reqs}, max_blocks_per_seq), got {tuple(block_table.shape)}"
            )
        layout = StepLayout.build(
            query_lens, start_positions, np.arange(num_reqs), block_size, block_table.shape[1], num_draft_tokens
        )
        return self.build_metadata(layout, block_table.long(), host_upload)
