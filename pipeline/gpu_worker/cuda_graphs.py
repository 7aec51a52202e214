"""CUDA graphs for decode-only steps (docs/design.md, "CUDA graphs for decode").

As vLLM, graphs are captured at start-up for a few batch sizes over static buffers; a decode-only step of ``B`` rows
runs as the smallest size ``>= B``. On CPU ``run`` calls the graph body eagerly (how tests check it).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import torch

from pipeline.gpu_worker.attention.backend import AttentionBackend, StepLayout, Upload
from pipeline.gpu_worker.attention.graph_decode import GraphDecodeAttention, GraphDecodeInputs
from pipeline.gpu_worker.attention.kv_layout import KVCache


def padded_size(sizes: Sequence[int], num_rows: int) -> int | None:
    """The smallest captured size (``sizes`` ascending) ``>= num_rows``, or None when ``num_rows`` exceeds them all."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


@dataclasses.dataclass
class GraphStep:
    """A decode-only step of ``num_tokens`` rows (one token each), run as the graph of ``size`` rows; ``positions``:
    ``[num_tokens]`` int64 on the device, the rows' positions."""

    num_tokens: int
    size: int
    graphs: DecodeGraphs
    positions: torch.Tensor

    def run(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [B]`` int64 -> ``[B, vocab]`` float32 logits, by ``DecodeGraphs.run``."""
        return self.graphs.run(self, input_ids)


class DecodeGraphs:
    """Token ids, logits, capture and replay of decode-only steps; ``block_table`` is read by the graphs at its address,
    ``pad_block`` is never handed out.

    Raises:
        ValueError: no sizes, or a KV cache without the padding block.
    """

    def __init__(
        self,
        model,
        attn_backend: AttentionBackend,
        kv_caches: list[KVCache],
        block_table: torch.Tensor,
        sizes: Sequence[int],
        block_size: int,
        pad_block: int,
    ) -> None:
        if not sizes:
            raise ValueError("CUDA graphs need at least one batch size")
        if kv_caches[0][0].shape[0] < (pad_block + 1) * block_size:
            raise ValueError(f"the KV cache has no padding block {pad_block}; allocate one block more")
        self.model, self.kv_caches = model, kv_caches
        self.sizes = sorted(sizes)
        self.device = block_table.device
        largest = self.sizes[-1]
        self.inputs = GraphDecodeInputs(largest, block_table, pad_block, block_size)
        self.attention = GraphDecodeAttention(attn_backend.cache_layout)
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=self.device)
        self.logits = torch.zeros(largest, model.config.vocab_size, dtype=torch.float32, device=self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def prepare(self, layout: StepLayout, upload: Upload, shift: torch.Tensor | None = None) -> GraphStep | None:
        """Fill the static buffers for a decode-only step; None if it runs eagerly (too big, or a prefill row)."""
        num_rows = layout.query_lens.size
        size = padded_size(self.sizes, num_rows)
        if size is None or layout.num_tokens != num_rows:
            return None
        positions = self.inputs.fill(layout, size, upload, shift)
        return GraphStep(num_tokens=num_rows, size=size, graphs=self, positions=positions)

    def run(self, step: GraphStep, input_ids: torch.Tensor) -> torch.Tensor:
        """Run ``step`` (the latest from ``prepare``) on ``input_ids`` (``[B]`` int64); returns ``[B, vocab]`` float32
        logits, a view the next step overwrites."""
        self.input_ids[: step.num_tokens].copy_(input_ids)
        graph = self._graphs.get(step.size)
        if graph is None:
            self.body(step.size)
        else:
            graph.replay()
        return self.logits[: step.num_tokens]

    def body(self, size: int) -> None:
        """The graph's work for ``size`` rows, from the static buffers to ``self.logits[:size]``."""
        meta = self.inputs.metadata(size)
        hidden = self.model(self.input_ids[:size], meta.positions, meta, self.kv_caches, self.attention)
        self.logits[:size].copy_(self.model.compute_logits(hidden))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size on the current CUDA device; the static buffers must hold padding rows only."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
            # One eager run on a side stream first initialises libraries and
            # picks kernels outside the capture, as the PyTorch docs advise.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.body(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.body(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
