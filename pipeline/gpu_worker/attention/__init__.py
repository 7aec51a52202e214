"""Attention backends over the paged KV cache.

:mod:`.backend` defines what the model and the runner see (per-step metadata,
per-layer forward); each backend is one module behind it (docs/design.md,
"The worker"):

- ``torch_bucketed`` (:mod:`.torch_bucketed`): SDPA per bucket of
  similar-length requests, cost following each request's own context; the
  default on CPU, and on CUDA when FlashInfer cannot serve;
- ``flashinfer`` (:mod:`.flashinfer_paged`): FlashInfer's paged-KV kernel, on
  CUDA with float16/bfloat16 when the package is installed;
- ``torch_sdpa`` (:mod:`.torch_sdpa`): padded decode and prefill groups; kept
  as the plain reference.

``--attention-backend`` picks one at start-up (:func:`make_backend`);
``auto`` takes the first of flashinfer and torch_bucketed that can run.
"""

from __future__ import annotations

import torch

from pipeline.common.config import ATTENTION_BACKENDS as BACKEND_CHOICES
from pipeline.gpu_worker.attention import flashinfer_paged
from pipeline.gpu_worker.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from pipeline.gpu_worker.attention.torch_bucketed import TorchBucketedBackend
from pipeline.gpu_worker.attention.torch_sdpa import TorchSDPABackend


def default_backend() -> AttentionBackend:
    """The backend a model uses unless told otherwise (the CPU default, ``torch_bucketed``)."""
    return TorchBucketedBackend()


def make_backend(name: str = "auto", *, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 num_heads: int = 0, num_kv_heads: int = 0, head_dim: int = 0) -> AttentionBackend:
    """The attention backend ``name`` for a model of this shape on ``device`` (docs/design.md, "The worker").

    Args:
        name: one of :data:`BACKEND_CHOICES`; ``auto`` is flashinfer where it
            can run (CUDA, float16/bfloat16, a supported head size, the
            package installed), torch_bucketed otherwise.
        device: where the model runs (default CPU).
        dtype: the model's and KV cache's dtype.
        num_heads, num_kv_heads, head_dim: the model's attention shape (only
            flashinfer needs it; 0 for the simulated device).

    Raises:
        ValueError: for an unknown name, or flashinfer asked for where it cannot run.
    """
    device = device or torch.device("cpu")
    if name not in BACKEND_CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_CHOICES)}")
    if name == "auto":
        usable = head_dim > 0 and flashinfer_paged.unsupported_reason(device, dtype, head_dim) is None
        name = "flashinfer" if usable else "torch_bucketed"
    if name == "flashinfer":
        if head_dim <= 0:
            raise ValueError("attention backend flashinfer needs a model (not the simulated device)")
        return flashinfer_paged.FlashInferBackend(num_heads, num_kv_heads, head_dim, dtype, device)
    return TorchBucketedBackend() if name == "torch_bucketed" else TorchSDPABackend()


__all__ = ["BACKEND_CHOICES", "AttentionBackend", "AttentionMetadata", "KVCache", "TorchBucketedBackend",
           "TorchSDPABackend", "default_backend", "make_backend"]
