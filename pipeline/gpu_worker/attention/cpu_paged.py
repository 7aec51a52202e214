"""The ``cpu_paged`` attention backend: decode rows, drafts included, read the paged cache in place.

``torch_bucketed`` copies each bucket's blocks into a scratch buffer in every layer before its SDPA call: for a
64-request decode step at contexts of 300 that is every row's whole K/V written once and read twice per layer, and on
this project's CPU the gather and the small-query SDPA calls took about half of the step (docs/design.md, "Attention
backends"). Here decode rows go through a C++ kernel (``cpu_paged.cpp``) that reads each row's keys and values block by
block straight from the cache, as vLLM's CPU paged-attention kernel does: one task per (row, KV head), on torch's
intra-op threads, its cost following the row's own context (no buckets, no padding). A row of up to ``DECODE_QUERY_MAX``
queries (a decode row verifying its speculative drafts) runs there too, its keys read once for all its queries. Longer
rows (prefill chunks) keep ``torch_bucketed``'s path (one SDPA call per bucket: its GEMM-shaped work suits SDPA), and
the cache memory is used head-major as there.

The kernel is compiled for the host CPU at start-up by ``torch.utils.cpp_extension`` (ninja and a C++ compiler; 10-50 s,
once per build key: ``kernel_cache``). Where it cannot be built or loaded, ``unavailable_reason`` says why and ``auto``
keeps ``torch_bucketed``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from pipeline.gpu_worker.attention import kernel_cache
from pipeline.gpu_worker.attention.kv_layout import HEAD_MAJOR, KVCache, write_kv
from pipeline.gpu_worker.attention.torch_bucketed import BucketedMetadata, TorchBucketedBackend

_SOURCE = Path(__file__).with_name("cpu_paged.cpp")
# -march=native: the library is built on the machine that runs it. -ffast-math
# lets the softmax's exp vectorize (glibc's libmvec) and the dot products
# reassociate; both stay within float32 rounding of the reference (the tests'
# 1e-5).
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"]

# Rows of up to this many queries go to the kernel; past it SDPA's GEMM-shaped work wins (docs/design.md,
# "Attention backends").
DECODE_QUERY_MAX = 32


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernel is built and loaded (first call builds it if no process has), else why it cannot be.

    The ops are then ``torch.ops.pipeline_cpu.paged_decode`` and ``.supports``.
    """
    try:
        kernel_cache.load("pipeline_cpu_paged", _SOURCE, _CFLAGS)
    except kernel_cache.KernelUnavailable as e:
        return str(e)
    return None


@functools.cache
def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel is compiled for this attention shape (it is specialised per query group and head size).

    Raises:
        RuntimeError: the kernel is not available (see ``unavailable_reason``).
    """
    if unavailable_reason() is not None:
        raise RuntimeError(f"cpu_paged kernel unavailable: {unavailable_reason()}")
    return num_heads % num_kv_heads == 0 and torch.ops.pipeline_cpu.supports(num_heads // num_kv_heads, head_dim)


class CpuPagedBackend(TorchBucketedBackend):
    """Decode rows by the in-place paged kernel, prefill rows as ``torch_bucketed`` (see the module docstring).

    Args:
        num_heads, num_kv_heads, head_dim: the model's attention shape; rows of several queries go to the kernel only
            for a shape it is compiled for (0: not known, decode rows of one query only).
        decode_query_max: rows verifying drafts of up to this many queries go to the kernel (1: decode rows only);
            prefill chunks never do.
        slack, min_pad, min_query_pad: prefill bucket limits (see ``plan_buckets``).

    Raises:
        RuntimeError: the kernel cannot be built or loaded here (the reason is given).
    """

    name = "cpu_paged"

    def __init__(
        self,
        num_heads: int = 0,
        num_kv_heads: int = 0,
        head_dim: int = 0,
        decode_query_max: int = DECODE_QUERY_MAX,
        **limits,
    ) -> None:
        super().__init__(head_major=True, **limits)
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"attention backend cpu_paged cannot run here: {reason}")
        self._kernel = torch.ops.pipeline_cpu.paged_decode
        # The padded fallback for other shapes serves rows of one query only.
        self.decode_query_max = decode_query_max if head_dim and supports(num_heads, num_kv_heads, head_dim) else 1

    def plan_decode(self, context_lens: np.ndarray) -> list[np.ndarray]:
        """All decode rows in one bucket: the kernel's cost already follows each row's own context."""
        return [np.arange(context_lens.size)]

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
        k_cache, v_cache = write_kv(kv_cache, k, v, meta.slot_mapping, HEAD_MAJOR)
        out = q.new_empty(q.shape)
        bs = meta.block_size
        for b in meta.decode:
            if supports(q.shape[1], k.shape[1], q.shape[2]):
                # Reads q and writes out at each row's token index: no gathered copies; a window's
                # older keys are not read at all.
                self._kernel(
                    out, q, k_cache, v_cache, b.token_index, b.query_lens, b.block_ids, b.context_lens, scale, bs,
                    window or 0, softcap or 0.0,
                )  # fmt: skip
            elif self.decode_query_max > 1:
                raise ValueError(
                    f"cpu_paged was set up for another attention shape than {q.shape[1]} heads over {k.shape[1]} "
                    f"KV heads of size {q.shape[2]}"
                )
            else:  # a shape the kernel is not built for: correct, padded to the longest row
                res = self.attend_bucket(q, k_cache, v_cache, b, bs, scale, window, softcap)
                out.index_copy_(0, b.out_tokens, res)
        for b in meta.prefill:
            out.index_copy_(0, b.out_tokens, self.attend_bucket(q, k_cache, v_cache, b, bs, scale, window, softcap))
        return out
