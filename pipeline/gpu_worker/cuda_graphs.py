"""CUDA graphs for decode-only steps (docs/design.md, "The worker").

A decode step of a small model is bound by kernel launches: every layer
enqueues a dozen small kernels, and the host takes longer to launch them than
the device to run them. A CUDA graph records a step's kernels once and
replays them with one launch (PyTorch, "CUDA Graphs",
https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs). A graph replays
fixed shapes at fixed addresses, so, as in vLLM's CUDA graph runner
(https://docs.vllm.ai/en/latest/design/cuda_graphs.html), graphs are captured
at start-up for a few batch sizes (``--cuda-graph-sizes``), and a decode-only
step of ``B`` rows runs as the graph of the smallest captured size ``n >= B``:

* **Static inputs.** :class:`DecodeGraphs` owns persistent device buffers:
  token ids (placeholders already resolved from the token-id cache, in stream
  order before the replay), and per row the req_index, the position and the context
  length. :meth:`DecodeGraphs.prepare` fills them from the step's host layout
  with one upload and one device copy; the graph itself reads the device block
  table (whose address never changes) and derives the block ids, the slot
  mapping and the attention mask on the device.
* **Padding rows** ``B .. n - 1`` have req_index -1, position 0 and a context of
  one token. Every block id of such a row is the **padding block**: the KV
  cache holds one block more than the scheduler hands out
  (:data:`PAD_BLOCKS`), so their keys and values land where nothing reads them
  but the padding rows themselves, and a one-token context keeps their
  softmax finite. Their logits are computed and dropped; stale token ids from
  earlier steps stay in their input positions (always valid ids).
* **Attention inside the graph** is the torch path: every row's blocks of its
  whole block-table row (``max_model_len`` rounded up to blocks) are gathered
  and attended with one masked SDPA call per layer, written and read in the
  cache layout of the model's eager backend (``torch_bucketed``'s head-major
  one, or the token-major one of ``torch_sdpa`` and ``flashinfer``). FlashInfer's
  CUDA-graph decode wrapper is not used.
* **Outputs.** The graph ends with the logits of all ``n`` rows in a static
  ``[max size, vocab]`` float32 buffer; the sampler runs right after the replay,
  eagerly, on the sampled rows (its plan depends on the batch's parameters).

Steps with a prefill row, or more rows than the largest size, run eagerly
through the model's own backend. :class:`CudaGraphBackend` wraps that backend
and makes the choice once per step, in ``build_metadata``.

The graphs share one memory pool, captured largest first so that the smaller
ones reuse its memory, after the KV cache is allocated. On CPU nothing is
captured: :meth:`DecodeGraphs.run` then calls the graph body eagerly on the
same padded static buffers, which is how the tests check it against the
eager path. Nothing here reads a device value on the host.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.gpu_worker.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    StepLayout,
    Upload,
    sdpa,
)
from pipeline.gpu_worker.attention.flashinfer_paged import FlashInferBackend
from pipeline.gpu_worker.attention.torch_bucketed import TorchBucketedBackend, gather_blocks, write_kv
from pipeline.gpu_worker.attention.torch_sdpa import TorchSDPABackend

if TYPE_CHECKING:
    from pipeline.gpu_worker.model_runner import ModelRunner

# KV blocks allocated beyond config.num_kv_blocks; block num_kv_blocks is the padding block.
PAD_BLOCKS = 1


def padded_size(sizes: Sequence[int], num_rows: int) -> int | None:
    """The smallest captured size ``>= num_rows``, or None when ``num_rows`` exceeds them all.

    Args:
        sizes: captured batch sizes, ascending.
        num_rows: rows of a decode-only step, >= 1.
    """
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


def cache_is_head_major(backend: AttentionBackend) -> bool:
    """Whether ``backend`` lays its cache memory out head-major (``[KVH, slots, D]``).

    Raises:
        ValueError: a backend whose cache layout the graph attention does not know.
    """
    if isinstance(backend, TorchBucketedBackend):
        return backend.head_major
    if isinstance(backend, (TorchSDPABackend, FlashInferBackend)):
        return False
    raise ValueError(f"CUDA graphs do not know the cache layout of attention backend {backend.name!r}")


@dataclasses.dataclass
class GraphDecodeMetadata(AttentionMetadata):
    """What the layers see inside the graph body of size ``n = num_tokens`` (all on the device).

    Attributes (beyond :class:`~pipeline.gpu_worker.attention.backend.AttentionMetadata`):
        block_ids: ``[n, max_blocks_per_seq]`` int64, each row's blocks; the
            padding block past a row's context and for padding rows.
        mask: ``[n, 1, 1, max_blocks_per_seq * block_size]`` bool, True for
            the keys a row attends (its context).
        head_major: the cache layout (see :func:`cache_is_head_major`).
        context_lens: ``[n]`` int64, each row's context in tokens.
        window_masks: ``mask`` narrowed to each sliding window the layers
            use (keys ``>= context - window``), made by the first layer that asks.
    """

    block_ids: torch.Tensor
    mask: torch.Tensor
    head_major: bool
    context_lens: torch.Tensor
    window_masks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The rows' mask for a layer with this sliding window (None: their whole context)."""
        if window is None:
            return self.mask
        if window not in self.window_masks:
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            recent = key_pos[None, :] >= (self.context_lens - window)[:, None]
            self.window_masks[window] = self.mask & recent[:, None, None, :]
        return self.window_masks[window]


@dataclasses.dataclass
class GraphStep(AttentionMetadata):
    """A decode-only step of ``B = num_tokens`` rows, run as the graph of ``size`` rows.

    ``positions`` and ``slot_mapping`` are ``[B]`` views of the static buffers
    (``slot_mapping`` holds this step's values once the graph has run).
    """

    size: int
    graphs: DecodeGraphs

    def run(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [B]`` int64 -> ``[B, vocab]`` float32 logits, by :meth:`DecodeGraphs.run`."""
        return self.graphs.run(self, input_ids)


def graph_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    meta: GraphDecodeMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention with shapes fixed by the graph size: write K/V, gather every row's blocks, one SDPA call.

    Args:
        q: ``[n, H, D]`` queries (RoPE applied), one per row.
        k, v: ``[n, KVH, D]``, written at ``meta.slot_mapping``.
        kv_cache: the layer's ``(k_cache, v_cache)``, ``[slots, KVH, D]`` as allocated.
        meta: the body's metadata.
        scale: softmax scale.
        window, softcap: as ``AttentionBackend.forward``.

    Returns:
        ``[n, H, D]``, dtype of ``q``.
    """
    k_cache, v_cache = write_kv(kv_cache, k, v, meta.slot_mapping, meta.head_major)
    rows, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    numel = meta.block_ids.numel() * meta.block_size * kv_heads * head_dim
    keys = gather_blocks(k_cache, meta.block_ids, meta.block_size, meta.head_major, k_cache.new_empty(numel))
    values = gather_blocks(v_cache, meta.block_ids, meta.block_size, meta.head_major, v_cache.new_empty(numel))
    # The heads sharing a KV head fold into the query dimension, so K/V are never expanded.
    return sdpa(
        q.reshape(rows, kv_heads, num_heads // kv_heads, head_dim), keys, values, meta.mask_for(window), scale, softcap
    ).reshape(rows, num_heads, head_dim)


class DecodeGraphs:
    """Static buffers, graph body, capture and replay of decode-only steps (see the module docstring).

    Args:
        model: a model of ``pipeline.gpu_worker.models``; its
            ``attn_backend`` must dispatch :class:`GraphDecodeMetadata` to
            :func:`graph_decode_attention` (:class:`CudaGraphBackend` does).
        kv_caches: the model's caches, with :data:`PAD_BLOCKS` blocks past ``pad_block - 1``.
        block_table: ``[max_num_reqs, max_blocks_per_seq]`` int64, the runner's device
            block table (read by the graph at this address).
        sizes: batch sizes to serve, ascending, >= 1.
        block_size: tokens per KV block.
        pad_block: the padding block's id (``config.num_kv_blocks``).
        head_major: the cache layout of the model's backend.

    Raises:
        ValueError: no sizes, or a KV cache without the padding block.
    """

    def __init__(
        self,
        model,
        kv_caches: list[KVCache],
        block_table: torch.Tensor,
        sizes: Sequence[int],
        block_size: int,
        pad_block: int,
        head_major: bool,
    ) -> None:
        if not sizes:
            raise ValueError("CUDA graphs need at least one batch size")
        if kv_caches[0][0].shape[0] < (pad_block + 1) * block_size:
            raise ValueError(f"the KV cache has no padding block {pad_block}; allocate {PAD_BLOCKS} more")
        self.model, self.kv_caches, self.block_table = model, kv_caches, block_table
        self.sizes = sorted(sizes)
        self.block_size, self.pad_block, self.head_major = block_size, pad_block, head_major
        device, largest = block_table.device, self.sizes[-1]
        # Rows: req_index, position, context length. Every row starts as a padding row.
        self.rows = torch.empty((3, largest), dtype=torch.int64, device=device)
        self.rows[0].fill_(-1)
        self.rows[1].fill_(0)
        self.rows[2].fill_(1)
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(largest, dtype=torch.int64, device=device)
        self.logits = torch.zeros(largest, model.config.vocab_size, dtype=torch.float32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def prepare(self, layout: StepLayout, upload: Upload) -> GraphStep | None:
        """Fill the static row buffers for a decode-only step; None if the step runs eagerly.

        Args:
            layout: the step's host layout.
            upload: the runner's host-to-device copy.
        """
        num_rows = layout.query_lens.size
        size = padded_size(self.sizes, num_rows)
        if size is None or layout.num_tokens != num_rows:  # too big, or a prefill row
            return None
        host = np.empty((3, size), dtype=np.int64)
        host[:, num_rows:] = [[-1], [0], [1]]
        host[0, :num_rows] = layout.req_indices
        host[1, :num_rows] = layout.start_positions
        host[2, :num_rows] = layout.start_positions + 1
        self.rows[:, :size].copy_(upload([host])[0])
        return GraphStep(
            num_tokens=num_rows,
            block_size=self.block_size,
            positions=self.rows[1, :num_rows],
            slot_mapping=self.slot_mapping[:num_rows],
            size=size,
            graphs=self,
        )

    def run(self, step: GraphStep, input_ids: torch.Tensor) -> torch.Tensor:
        """Run ``step``: its captured graph, or the body eagerly where none was captured (CPU).

        Args:
            step: from :meth:`prepare`, the latest one (the buffers hold its rows).
            input_ids: ``[B]`` int64 on the device, placeholders resolved.

        Returns:
            ``[B, vocab]`` float32 logits, a view of the static buffer that the
            next step overwrites (consume it in stream order before then).
        """
        self.input_ids[: step.num_tokens].copy_(input_ids)
        graph = self._graphs.get(step.size)
        if graph is None:
            self.body(step.size)
        else:
            graph.replay()
        return self.logits[: step.num_tokens]

    def body(self, size: int) -> None:
        """The graph's work for ``size`` rows, from the static buffers to ``self.logits[:size]``."""
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
        mask = (key_pos[None, :] < context_lens[:, None])[:, None, None, :]
        meta = GraphDecodeMetadata(
            num_tokens=size,
            block_size=bs,
            positions=positions,
            slot_mapping=self.slot_mapping[:size],
            block_ids=block_ids,
            mask=mask,
            head_major=self.head_major,
            context_lens=context_lens,
        )
        hidden = self.model(self.input_ids[:size], positions, meta, self.kv_caches)
        self.logits[:size].copy_(self.model.compute_logits(hidden))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size on the current CUDA device (PyTorch's ``torch.cuda.graph``).

        The row buffers must hold padding rows only (as after construction),
        so warm-up and capture write nothing but the padding block.
        """
        device = self.block_table.device
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
            # One eager run on a side stream first initialises libraries and
            # picks kernels outside the capture, as the PyTorch docs advise.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self.body(size)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.body(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(device)


class CudaGraphBackend(AttentionBackend):
    """The model's backend, with decode-only steps that fit a graph served by :class:`DecodeGraphs`.

    ``build_metadata`` returns a :class:`GraphStep` for those (the executor
    then runs the graph) and the wrapped backend's metadata otherwise;
    ``forward`` runs :func:`graph_decode_attention` inside the graph body and
    the wrapped backend's forward on eager steps.

    Args:
        inner: the backend eager steps use.
        graphs: the graphs and their static buffers.
    """

    def __init__(self, inner: AttentionBackend, graphs: DecodeGraphs) -> None:
        self.inner, self.graphs = inner, graphs
        self.name = inner.name

    def build_metadata(self, layout: StepLayout, block_table: torch.Tensor, upload: Upload) -> AttentionMetadata:
        step = self.graphs.prepare(layout, upload)
        return step if step is not None else self.inner.build_metadata(layout, block_table, upload)

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
        if isinstance(meta, GraphDecodeMetadata):
            return graph_decode_attention(q, k, v, kv_cache, meta, scale, window, softcap)
        return self.inner.forward(q, k, v, kv_cache, meta, scale, window, softcap)


def install_decode_graphs(runner: ModelRunner, sizes: Sequence[int]) -> DecodeGraphs:
    """Serve ``runner``'s decode-only steps of up to ``max(sizes)`` rows through graphs; capture them on CUDA.

    Call once, after the runner (and so the KV cache and block table) exists.
    On CPU nothing is captured and graph steps run the body eagerly.

    Args:
        runner: a runner over a :class:`~pipeline.gpu_worker.executor.ModelExecutor`.
        sizes: batch sizes, each >= 1.

    Raises:
        ValueError: as :class:`DecodeGraphs` and :func:`cache_is_head_major`.
    """
    executor = runner.executor
    model = executor.model
    graphs = DecodeGraphs(
        model,
        executor.kv_caches,
        runner.input_batch.block_table,
        sizes,
        runner.config.block_size,
        pad_block=runner.config.num_kv_blocks,
        head_major=cache_is_head_major(model.attn_backend),
    )
    executor.attn_backend = model.attn_backend = CudaGraphBackend(model.attn_backend, graphs)
    if runner.device.type == "cuda":
        graphs.capture()
    return graphs
