"""The attention-backend interface: per-step metadata, per-layer forward.

The runner asks the backend once per step for its metadata; every layer then calls ``forward`` with its own queries,
keys, values and KV cache and that metadata, so a new backend is a new module, not an edit of the model or the runner
(docs/design.md, "Attention backends"). Metadata is built without waiting for the device: what the batch shapes is
decided on the host (``StepLayout``) and uploaded at once; what is large is computed on the device from it. Each backend
declares how it uses the cache's memory (``cache_layout``, ``kv_layout.py``). With speculative decoding the host's start
positions may be upper bounds, and a per-row ``shift`` on the device moves every position, context length and slot
derived from them back (docs/design.md, "Speculative decoding").
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
    """``scaled_dot_product_attention`` over ``[B, H, Q, D]`` queries and ``[B, KVH, K, D]`` keys, with the scores
    soft-capped when ``softcap`` is set.

    SDPA cannot cap scores, so a capped call runs the attention as transformers' eager path does: matmul, cap, mask,
    softmax in float32, matmul.
    """
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
    """One step's token layout, computed on the host (numpy int64; no device values).

    Request ``i`` owns step tokens ``[token_starts[i], token_starts[i] + query_lens[i])``; their positions are
    ``start_positions[i] + 0 .. query_lens[i] - 1``.

    Attributes:
        query_lens: ``[B]`` tokens scheduled per request, each >= 1.
        start_positions: ``[B]`` position of each request's first scheduled token (= tokens already in its KV cache).
        req_indices: ``[B]`` each request's row in the block table.
        num_draft_tokens: ``[B]`` drafts among each request's last queries (a row verifying them); 0 for a decode row or
            a prefill chunk.
        block_size: tokens per KV cache block.
        token_starts: ``[B]`` exclusive cumulative sum of ``query_lens``.
        request_of_token: ``[T]`` the request each token belongs to.
        positions: ``[T]`` position of each token in its sequence.
        num_tokens: T.
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
        """Check and lay out a step.

        Args:
            query_lens, start_positions, req_indices: ``[B]`` integer arrays (or host tensors).
            num_draft_tokens: ``[B]`` integers, each below its query_len; None: no drafts.
            block_size: tokens per KV cache block.
            max_blocks_per_seq: width of a block-table row.

        Raises:
            ValueError: on inconsistent shapes, an empty batch, a query_len < 1, a negative start position, or a context
                that does not fit a block-table row.
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
    """Requests ``rows`` of a step as a ``[R, q_max]`` grid of queries, for backends that pad rows.

    Padded query positions repeat the row's last real query: a valid token index and a non-empty mask row, whose output
    is then dropped.

    Attributes:
        q_max: the longest row's scheduled tokens.
        n_blocks: KV blocks of the longest context.
        context_lens: ``[R]`` int64 tokens each row attends to after this step.
        token_index: ``[R, q_max]`` int64 index of each query in the step's tokens.
        query_pos: ``[R, q_max]`` int64 position of each query.
        real: ``[R * q_max]`` bool, the grid's real queries (row-major).
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
    """``(positions, token_req_indices, token_cols)`` of the step's tokens on the device, moved back by ``shift``.

    Args:
        layout_dev: the device copies of ``StepLayout.shifted_inputs``' arrays, in order.
        shift: ``[B]`` int64 per row on the device, or None (the layout is exact).
        block_size: tokens per KV block.
    """
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
    """``[T]`` int64 flat KV-cache index of each token, on the device.

    Args:
        block_table: ``[rows, max_blocks_per_seq]`` int64.
        token_req_indices, token_cols: ``[T]`` the block-table row and column of each token (from
            ``StepLayout.slot_mapping_inputs``).
        positions: ``[T]`` each token's position.
    """
    return block_table[token_req_indices, token_cols] * block_size + positions % block_size


@dataclasses.dataclass
class AttentionMetadata:
    """Fields every backend's per-step metadata has; backends subclass it.

    Attributes:
        num_tokens: T, the number of tokens in the step.
        block_size: tokens per KV cache block.
        positions: ``[T]`` int64 on the device, position of each token in its sequence (the model's RoPE index).
        slot_mapping: ``[T]`` int64 on the device, flat KV cache index each token's key and value are written to.
    """

    num_tokens: int
    block_size: int
    positions: torch.Tensor
    slot_mapping: torch.Tensor


class AttentionBackend(ABC):
    """Paged attention for one model: metadata once per step, forward per layer.

    A backend instance belongs to one model and may keep scratch memory shared by its layers (layers run one after
    another, in stream order).

    Attributes:
        name: its registry name (``attention.ATTENTION_BACKENDS``).
        cache_layout: ``kv_layout.TOKEN_MAJOR`` or ``HEAD_MAJOR``.
    """

    name: str = "abstract"
    cache_layout: str = TOKEN_MAJOR

    @abstractmethod
    def build_metadata(
        self, layout: StepLayout, block_table: torch.Tensor, upload: Upload, shift: torch.Tensor | None = None
    ) -> AttentionMetadata:
        """Lay out one step on the device without waiting for it.

        Args:
            layout: the step's host-side layout.
            block_table: ``[rows, max_blocks_per_seq]`` int64 on the device; request ``i`` uses row
                ``layout.req_indices[i]``. Entries past a request's context are ignored and may hold anything.
            upload: moves the host arrays the build derives to the device.
            shift: ``[B]`` int64 on the device: row ``i`` starts ``shift[i]`` positions before
                ``layout.start_positions[i]`` (the drafts of its previous step that were rejected); None: the layout is
                exact.

        Raises:
            ValueError: a ``shift`` for a backend that needs exact host positions.
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
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write this step's keys and values into ``kv_cache``, then attend.

        Each token attends to itself and to every earlier position of its own sequence (earlier steps' keys come from
        the cache), or only to the last ``window`` of them.

        Args:
            q: ``[T, H, D]`` queries (RoPE applied).
            k: ``[T, KVH, D]`` keys (RoPE applied), H a multiple of KVH.
            v: ``[T, KVH, D]`` values.
            kv_cache: the layer's ``(k_cache, v_cache)``, written in place.
            meta: this step's metadata from ``build_metadata``.
            scale: softmax scale, usually ``D ** -0.5``.
            window: a sliding window of this many keys, the query's own included (position p attends p - window + 1 ..
                p, as transformers masks); None: the whole context.
            softcap: scores ``s`` become ``softcap * tanh(s / softcap)`` before the mask and softmax (Gemma 2); None:
                none.

        Returns:
            ``[T, H, D]`` attention output, dtype of ``q``.
        """

    def build_from_rows(
        self, query_lens, start_positions, block_table: torch.Tensor, block_size: int, num_draft_tokens=None
    ) -> AttentionMetadata:
        """``build_metadata`` with one block-table row per request, for CPU tensors (tests, benchmarks).

        Args:
            query_lens, start_positions: ``[B]`` host integers.
            block_table: ``[B, max_blocks_per_seq]`` integer CPU tensor, row ``i`` for request ``i``.
            num_draft_tokens: as ``StepLayout.build``.

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
