"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``.

``SyncGuard`` is a ``TorchFunctionMode`` that tracks which tensors live
on the "device" and flags every call that, on a CUDA device, would make the
host wait for a stream:

* reading a device tensor on the host: ``item``, ``tolist``, ``cpu``,
  ``numpy``, ``__array__``, ``__bool__``/``__int__``/``__float__``/``__index__``,
  printing it, ``torch.equal``/``allclose``;
* ops whose output size depends on device data: ``nonzero``, ``argwhere``,
  ``masked_select``, ``unique``, boolean-mask indexing, ``repeat_interleave``
  with tensor repeats and no ``output_size``;
* host -> device copies from pageable memory or blocking ones (``.to(device)``,
  ``copy_``, ``torch.tensor(..., device=)``), and device -> host copies that
  are not ``non_blocking`` into pinned memory;
* a host tensor (not a 0-dim scalar) fed to a device op: CUDA copies it
  synchronously (an index) or fails;
* ``synchronize`` on an event or stream of ``FakeAsyncOps``.

Which tensors are on the device: the roots given to ``SyncGuard.mark_device``
(model weights, KV cache, the runner's input batch), anything a factory call
makes with an explicit ``device=``, anything uploaded through
``FakeAsyncOps``, and every output of an op that reads a device tensor.
"Pinned" host tensors are the staging buffers ``FakeAsyncOps`` hands out
(and views of their storage).

``FakeAsyncOps`` is the CUDA code path of ``AsyncOps``
(staging, uploads, copy stream, events) run on the CPU: it differs from
``CudaOps`` only in where buffers and events
come from.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from pipeline.gpu_worker.device import AsyncOps

T = torch.Tensor
_HOST_READS = {
    T.item,
    T.tolist,
    T.numpy,
    T.cpu,
    T.__array__,
    T.__bool__,
    T.__int__,
    T.__float__,
    T.__index__,
    T.__repr__,
    T.__format__,
    T.__str__,
    T.equal,
    torch.equal,
    T.allclose,
    torch.allclose,
    T.is_nonzero,
}
_DATA_DEPENDENT_SHAPE = {
    torch.nonzero,
    T.nonzero,
    torch.argwhere,
    T.argwhere,
    torch.masked_select,
    T.masked_select,
    torch.unique,
    T.unique,
    torch.unique_consecutive,
    T.unique_consecutive,
    torch.bincount,
    T.bincount,
}
_HOST_DATA_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


class SyncGuard(TorchFunctionMode):
    """Records (and, with ``raise_on_sync``, raises on) every would-be device sync while ``active``."""

    def __init__(self, raise_on_sync: bool = False):
        super().__init__()
        self.raise_on_sync = raise_on_sync
        self.active = True
        self.violations: list[str] = []
        self._device: dict[int, weakref.ref] = {}
        self._pinned: dict[int, torch.Tensor] = {}

    # -- bookkeeping ------------------------------------------------------------

    @staticmethod
    def _add(table: dict[int, weakref.ref], t: torch.Tensor) -> None:
        key = id(t)
        table[key] = weakref.ref(t, lambda _, k=key: table.pop(k, None))

    @staticmethod
    def _has(table: dict[int, weakref.ref], t: torch.Tensor) -> bool:
        for x in (t, t._base):
            if x is not None and id(x) in table and table[id(x)]() is x:
                return True
        return False

    def mark_device(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._add(self._device, t)

    def mark_pinned(self, t: torch.Tensor) -> None:
        # Keyed by storage, and kept alive (so the address is never reused):
        # a view made in inference mode has no ``_base`` and may outlive the
        # Python object of the buffer it views.
        self._pinned[t.untyped_storage().data_ptr()] = t

    def on_device(self, t: torch.Tensor) -> bool:
        return self._has(self._device, t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._pinned

    def flag(self, what: str) -> None:
        if not self.active:
            return
        self.violations.append(what)
        if self.raise_on_sync:
            raise AssertionError(f"would synchronise with the device: {what}")

    @contextlib.contextmanager
    def paused(self):
        """Let the enclosed code sync (e.g. ``finish``, which waits by design)."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    # -- the mode -----------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        dev_in = any(self.on_device(t) for t in tensors)
        if self.active:
            self._check(func, args, kwargs, tensors, dev_in)
        out = func(*args, **kwargs)
        makes_device = dev_in or (kwargs.get("device") is not None and func not in _HOST_DATA_FACTORIES)
        if func in (T.to, T.cuda) and not dev_in:
            makes_device = self._to_target(args, kwargs) is not None
        if func is T.copy_:
            makes_device = False  # the destination keeps its side
        if makes_device:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.mark_device(t)
        return out

    @staticmethod
    def _to_target(args, kwargs):
        if kwargs.get("device") is not None:
            return kwargs["device"]
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                return a
        return None

    def _check(self, func, args, kwargs, tensors, dev_in) -> None:
        name = _name(func)
        if func in _HOST_READS and dev_in:
            self.flag(f"{name} reads a device tensor on the host")
        elif func in _DATA_DEPENDENT_SHAPE and dev_in:
            self.flag(f"{name} on a device tensor: its output size is read back")
        elif func in (torch.repeat_interleave, T.repeat_interleave) and dev_in and kwargs.get("output_size") is None:
            if any(isinstance(a, torch.Tensor) for a in args[1:2]) or isinstance(kwargs.get("repeats"), torch.Tensor):
                self.flag(f"{name} with device repeats and no output_size")
        elif func in _HOST_DATA_FACTORIES and kwargs.get("device") is not None:
            self.flag(f"{name}(..., device=) copies host data to the device synchronously")
        elif func is T.new_tensor and dev_in:
            self.flag(f"{name} copies host data to the device synchronously")
        elif func in (T.to, T.cuda):
            target = self._to_target(args, kwargs)
            if target is not None or func is T.cuda:
                src = args[0]
                non_blocking = bool(kwargs.get("non_blocking", False))
                if dev_in:
                    self.flag(f"{name}(device) of a device tensor (a device->host or redundant copy)")
                elif not (self.is_pinned(src) and non_blocking):
                    self.flag(
                        f"{name}(device) from {'pinned' if self.is_pinned(src) else 'pageable'} host memory"
                        f"{'' if non_blocking else ', blocking'}"
                    )
        elif func is T.copy_:
            dst, src = args[0], args[1]
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            if isinstance(src, torch.Tensor) and self.on_device(dst) != self.on_device(src):
                host = src if self.on_device(dst) else dst
                if not (self.is_pinned(host) and non_blocking):
                    direction = "host->device" if self.on_device(dst) else "device->host"
                    self.flag(
                        f"copy_ {direction} through {'pinned' if self.is_pinned(host) else 'pageable'} "
                        f"memory{'' if non_blocking else ', blocking'}"
                    )
        elif func in (T.__getitem__, T.__setitem__, T.index_put_, T.index_put, torch.index_put) and dev_in:
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            for t in tree_flatten(index)[0]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.bool and self.on_device(t):
                    self.flag(f"{name} with a boolean device mask (nonzero)")
        if dev_in and func not in (T.copy_, T.to, T.cuda):
            host = [t for t in tensors if not self.on_device(t) and t.dim() > 0]
            if host:
                self.flag(
                    f"{name} mixes a host tensor {tuple(host[0].shape)} into a device op (a synchronous copy on CUDA)"
                )


class FakeEvent:
    """A CUDA event stand-in; the work it marks has always run (CPU torch is synchronous)."""

    def __init__(self, guard: SyncGuard, timing: bool):
        self.guard, self.timing, self.time_ns = guard, timing, None

    def record(self, stream=None) -> None:
        self.time_ns = time.monotonic_ns()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.guard.flag("Event.synchronize")

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.timing and other.timing, "elapsed_time needs timing events"
        return (other.time_ns - self.time_ns) / 1e6


class FakeStream:
    def __init__(self, guard: SyncGuard):
        self.guard = guard

    def wait_event(self, event: FakeEvent) -> None:
        assert event.time_ns is not None, "waiting on an event that was never recorded"

    def synchronize(self) -> None:
        self.guard.flag("Stream.synchronize")


class FakeAsyncOps(AsyncOps):
    """``AsyncOps`` on the CPU, watched by ``guard``."""

    def __init__(self, device: torch.device, guard: SyncGuard):
        super().__init__(device)
        self.guard = guard
        self.copy_stream = FakeStream(guard)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        self.guard.mark_pinned(t)
        return t

    def new_event(self, timing: bool = False) -> FakeEvent:
        return FakeEvent(self.guard, timing)

    @contextlib.contextmanager
    def copy_stream_ctx(self, ready: FakeEvent):
        self.copy_stream.wait_event(ready)
        yield
