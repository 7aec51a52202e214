"""The attention backends and how one is chosen (docs/design.md, "Attention backends"); registering imports no torch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import torch

    from pipeline.gpu_worker.attention.backend import AttentionBackend

_LOG = logging.getLogger(__name__)

T = TypeVar("T")


class Registry(Generic[T]):
    """Named factories of one kind of part, added by decorator; a factory's docstring describes its part."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def add(factory: Callable[..., T]) -> Callable[..., T]:
            self._factories[name] = factory
            return factory

        return add

    def names(self) -> tuple[str, ...]:
        return tuple(self._factories)

    def describe(self, name: str) -> str:
        return " ".join((self._factories[name].__doc__ or "").split())

    def make(self, name: str, *args, **kwargs) -> T:
        """Raises ValueError for a name not registered, or whatever the factory raises."""
        factory = self._factories.get(name)
        if factory is None:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self._factories)}")
        return factory(*args, **kwargs)


@dataclass(frozen=True)
class ModelShape:
    """What a backend is made for: device and attention shape (0: the simulated device); ``scale`` and ``kinds`` only
    for backends that plan per step (flashinfer)."""

    device: torch.device
    dtype: torch.dtype
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    scale: float | None = None
    kinds: Sequence[tuple[int | None, float | None]] = ((None, None),)


class NotForThisModel(ValueError):
    """The backend is not made for this device, dtype or shape."""


class BackendUnavailable(RuntimeError):
    """The backend would suit the model but cannot run here (its kernel does not build, say)."""


ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention backend")


@ATTENTION_BACKENDS.register("cpu_paged")
def _cpu_paged(m: ModelShape) -> AttentionBackend:
    """a C++ kernel (built at start-up) reads the paged cache in place for decode rows; CPU, float32/bfloat16"""
    import torch

    from pipeline.gpu_worker.attention import cpu_paged

    if m.device.type != "cpu" or m.dtype not in (torch.float32, torch.bfloat16):
        raise NotForThisModel(
            f"attention backend cpu_paged runs on CPU in float32 or bfloat16, not {m.device} {m.dtype}"
        )
    if (reason := cpu_paged.unavailable_reason()) is not None:
        raise BackendUnavailable(f"cpu_paged attention unavailable ({reason})")
    if m.head_dim and not cpu_paged.supports(m.num_heads, m.num_kv_heads, m.head_dim):
        raise BackendUnavailable(
            f"cpu_paged attention is not built for {m.num_heads} heads over {m.num_kv_heads} KV heads "
            f"of size {m.head_dim}"
        )
    return cpu_paged.CpuPagedBackend(m.num_heads, m.num_kv_heads, m.head_dim)


@ATTENTION_BACKENDS.register("torch_bucketed")
def _torch_bucketed(m: ModelShape) -> AttentionBackend:
    """SDPA per bucket of similar-length requests, so each request's cost follows its own context"""
    from pipeline.gpu_worker.attention.torch_bucketed import TorchBucketedBackend

    return TorchBucketedBackend()


@ATTENTION_BACKENDS.register("flashinfer")
def _flashinfer(m: ModelShape) -> AttentionBackend:
    """FlashInfer's paged-KV kernel; CUDA, float16/bfloat16, the flashinfer package installed"""
    from pipeline.gpu_worker.attention import flashinfer_paged

    if m.head_dim <= 0:
        raise NotForThisModel("attention backend flashinfer needs a model (not the simulated device)")
    if (reason := flashinfer_paged.unsupported_reason(m.device, m.dtype, m.head_dim)) is not None:
        raise NotForThisModel(f"attention backend flashinfer: {reason}")
    return flashinfer_paged.FlashInferBackend(
        m.num_heads, m.num_kv_heads, m.head_dim, m.dtype, m.device, m.scale, m.kinds
    )


@ATTENTION_BACKENDS.register("torch_sdpa")
def _torch_sdpa(m: ModelShape) -> AttentionBackend:
    """every decode row padded to the step's longest context (the reference)"""
    from pipeline.gpu_worker.attention.torch_sdpa import TorchSDPABackend

    return TorchSDPABackend()


# What auto tries, in order, for a model; torch_bucketed when none can run.
_AUTO = ("flashinfer", "cpu_paged")


def make_backend(
    name: str = "auto",
    *,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    num_heads: int = 0,
    num_kv_heads: int = 0,
    head_dim: int = 0,
    scale: float | None = None,
    kinds: Sequence[tuple[int | None, float | None]] = ((None, None),),
) -> AttentionBackend:
    """The attention backend ``name`` (or ``auto``: flashinfer, then cpu_paged, else torch_bucketed) for a model of this
    shape on ``device`` (default CPU, float32).

    Raises:
        ValueError: an unknown name, or a backend not made for this model (``NotForThisModel``).
        RuntimeError: a backend that cannot run here (``BackendUnavailable``).
    """
    import torch

    shape = (num_heads, num_kv_heads, head_dim, scale, tuple(kinds))
    m = ModelShape(device or torch.device("cpu"), dtype or torch.float32, *shape)
    if name != "auto":
        return ATTENTION_BACKENDS.make(name, m)
    if head_dim > 0:
        for candidate in _AUTO:
            try:
                return ATTENTION_BACKENDS.make(candidate, m)
            except NotForThisModel:
                pass
            except BackendUnavailable as e:
                _LOG.warning("%s; using torch_bucketed", e)
    return ATTENTION_BACKENDS.make("torch_bucketed", m)


def default_backend() -> AttentionBackend:
    """The backend a model uses unless told otherwise (``torch_bucketed``)."""
    return make_backend("torch_bucketed")
