"""Attention backends over the paged KV cache.

:mod:`.backend` defines what the model and the runner see (per-step metadata,
per-layer forward); each backend is one module behind it (docs/design.md,
"The worker"):

- ``cpu_paged`` (:mod:`.cpu_paged`): a C++ kernel that reads the paged
  cache in place for decode rows, ``torch_bucketed``'s path for prefill; the
  default on CPU where the kernel builds;
- ``torch_bucketed`` (:mod:`.torch_bucketed`): SDPA per bucket of
  similar-length requests, cost following each request's own context; the
  default on CPU without a compiler, and on CUDA when FlashInfer cannot serve;
- ``flashinfer`` (:mod:`.flashinfer_paged`): FlashInfer's paged-KV kernel, on
  CUDA with float16/bfloat16 when the package is installed;
- ``torch_sdpa`` (:mod:`.torch_sdpa`): padded decode and prefill groups; kept
  as the plain reference.

``--attention-backend`` picks one at start-up (:func:`make_backend`);
``auto`` takes the first of flashinfer, cpu_paged and torch_bucketed that can run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from pipeline.common.config import ATTENTION_BACKENDS as BACKEND_CHOICES
from pipeline.gpu_worker.attention import cpu_paged, flashinfer_paged
from pipeline.gpu_worker.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from pipeline.gpu_worker.attention.cpu_paged import CpuPagedBackend
from pipeline.gpu_worker.attention.torch_bucketed import TorchBucketedBackend
from pipeline.gpu_worker.attention.torch_sdpa import TorchSDPABackend

_LOG = logging.getLogger(__name__)


# What the cpu_paged kernel is built for.
CPU_PAGED_DTYPES = (torch.float32, torch.bfloat16)


def default_backend() -> AttentionBackend:
    """The backend a model uses unless told otherwise (the CPU default, ``torch_bucketed``)."""
    return TorchBucketedBackend()


def make_backend(
    name: str = "auto",
    *,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    num_heads: int = 0,
    num_kv_heads: int = 0,
    head_dim: int = 0,
    scale: float | None = None,
    kinds: Sequence[tuple[int | None, float | None]] = ((None, None),),
) -> AttentionBackend:
    """The attention backend ``name`` for a model of this shape on ``device`` (docs/design.md, "The worker").

    Args:
        name: one of :data:`BACKEND_CHOICES`; ``auto`` is flashinfer where it
            can run (CUDA, float16/bfloat16, a supported head size, the
            package installed), cpu_paged on CPU in float32/bfloat16 where its
            kernel builds for this shape (else one log line), torch_bucketed
            otherwise.
        device: where the model runs (default CPU).
        dtype: the model's and KV cache's dtype.
        num_heads, num_kv_heads, head_dim: the model's attention shape (only
            flashinfer needs it; 0 for the simulated device).
        scale, kinds: the model's softmax scale (default ``head_dim ** -0.5``)
            and its layers' ``(window, softcap)`` pairs, which flashinfer plans
            per step (the other backends take them per layer).

    Raises:
        ValueError: for an unknown name, or flashinfer or cpu_paged asked for where it cannot run.
        RuntimeError: cpu_paged asked for where its kernel cannot be built.
    """
    device = device or torch.device("cpu")
    if name not in BACKEND_CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_CHOICES)}")
    if name == "auto":
        usable = head_dim > 0 and flashinfer_paged.unsupported_reason(device, dtype, head_dim) is None
        name = "flashinfer" if usable else "torch_bucketed"
        if name == "torch_bucketed" and head_dim > 0 and device.type == "cpu" and dtype in CPU_PAGED_DTYPES:
            reason = cpu_paged.unavailable_reason()
            if reason is None and cpu_paged.supports(num_heads, num_kv_heads, head_dim):
                name = "cpu_paged"
            elif reason is None:
                _LOG.warning(
                    "cpu_paged attention is not built for %d heads over %d KV heads of size %d; using torch_bucketed",
                    num_heads,
                    num_kv_heads,
                    head_dim,
                )
            else:
                _LOG.warning("cpu_paged attention unavailable (%s); using torch_bucketed", reason)
    if name == "flashinfer":
        if head_dim <= 0:
            raise ValueError("attention backend flashinfer needs a model (not the simulated device)")
        return flashinfer_paged.FlashInferBackend(num_heads, num_kv_heads, head_dim, dtype, device, scale, kinds)
    if name == "cpu_paged":
        if device.type != "cpu" or dtype not in CPU_PAGED_DTYPES:
            raise ValueError(f"attention backend cpu_paged runs on CPU in float32 or bfloat16, not {device} {dtype}")
        return CpuPagedBackend()
    return TorchBucketedBackend() if name == "torch_bucketed" else TorchSDPABackend()


__all__ = [
    "BACKEND_CHOICES",
    "AttentionBackend",
    "AttentionMetadata",
    "CpuPagedBackend",
    "KVCache",
    "TorchBucketedBackend",
    "TorchSDPABackend",
    "default_backend",
    "make_backend",
]
