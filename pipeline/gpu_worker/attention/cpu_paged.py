"""The ``cpu_paged`` attention backend: decode rows, drafts included, read the paged cache in place (docs/design.md,
"Attention backends").

Rows of up to ``DECODE_QUERY_MAX`` queries go through a C++ kernel (``cpu_paged.cpp``, as vLLM's CPU paged attention):
one task per (row, KV head), no gather. Prefill rows keep ``torch_bucketed``'s path. The kernel compiles at start-up
(``kernel_cache``); ``unavailable_reason`` says why not.
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
# 1e-5). -fopenmp: at::parallel_for is inline OpenMP in torch's CPU builds, and
# without it runs on one thread.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

# Rows of up to this many queries go to the kernel; past it SDPA's GEMM-shaped work wins (docs/design.md,
# "Attention backends").
DECODE_QUERY_MAX = 32


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernel (``torch.ops.pipeline_cpu``) is built and loaded, building it if needed; else why it cannot
    be."""
    try:
        kernel_cache.load("pipeline_cpu_paged", _SOURCE, _CFLAGS)
    except kernel_cache.KernelUnavailable as e:
        return str(e)
    return None


@functools.cache
def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel is compiled for this attention shape (specialised per query group and head size).

    Raises:
        RuntimeError: the kernel is not available (see ``unavailable_reason``).
    """
    if unavailable_reason() is not None:
        raise RuntimeError(f"cpu_paged kernel unavailable: {unavailable_reason()}")
    return num_heads % num_kv_heads == 0 and torch.ops.pipeline_cpu.supports(num_heads // num_kv_heads, head_dim)


class CpuPagedBackend(TorchBucketedBackend):
    """Decode rows by the in-place paged kernel, prefill rows as ``torch_bucketed`` (see the module docstring).

    ``num_heads`` etc. 0: unknown, one-query rows only; ``decode_query_max`` 1: decode rows only.

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
