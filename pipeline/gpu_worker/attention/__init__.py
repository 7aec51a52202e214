"""Attention backends over the paged KV cache.

:mod:`.backend` defines what the model and the runner see (per-step metadata,
per-layer forward); each backend is one module behind it. ``torch_sdpa`` is
the only one today.
"""

from pipeline.gpu_worker.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from pipeline.gpu_worker.attention.torch_sdpa import TorchSDPABackend


def default_backend() -> AttentionBackend:
    """The backend a model uses unless told otherwise."""
    return TorchSDPABackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "TorchSDPABackend", "default_backend"]
