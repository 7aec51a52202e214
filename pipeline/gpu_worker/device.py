"""How the runner moves data to and from its device and marks time there (docs/design.md, "Nothing in `launch` waits for
the device").

Uploads pack host arrays into one staging buffer (pinned on CUDA) copied non-blocking; downloads copy into fresh pinned
memory on a copy stream, gated by events. ``DeviceOps`` is CPU torch, ``CudaOps`` the GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import numpy as np
import torch

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}
# Each array starts at a multiple of this many bytes of the staging buffer, so
# its slice of the device copy can be viewed as its dtype.
_ALIGN = 8


class DeviceOps:
    """CPU torch: synchronous, and host arrays are used in place; ``is_async``: events, not wall time, time enqueued
    work."""

    is_async = False

    def __init__(self, device: torch.device):
        self.device = device

    def upload(self, arrays: Sequence[np.ndarray], dtype: type = np.int64) -> list[torch.Tensor]:
        """Device copies of ``arrays`` (each cast to ``dtype``: int64, int32 or float32), in order, in one copy; on CPU
        they share memory with the cast arrays."""
        return self.upload_mixed([np.asarray(a, dtype=dtype) for a in arrays])

    def upload_mixed(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device copies of ``arrays``, each keeping its own dtype (int64, int32 or float32), in one copy."""
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]

    def copy_to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """Start copying ``t`` to the host; returns ``(host tensor, done event or None)``, the tensor valid once it
        fired."""
        return t, None

    def timing_event(self) -> object | None:
        """An event recorded now on the compute stream (None where nothing is timed by events)."""
        return None


class AsyncOps(DeviceOps):
    """A stream-ordered device: staging buffers, non-blocking copies, events; subclasses provide ``host_buffer``,
    ``new_event`` and ``copy_stream_ctx``."""

    is_async = True

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh 1-D host buffer the device can copy asynchronously (pinned)."""
        raise NotImplementedError

    def new_event(self, timing: bool = False):
        """An unrecorded event; ``timing`` enables ``elapsed_time``."""
        raise NotImplementedError

    def copy_stream_ctx(self, ready) -> contextlib.AbstractContextManager:
        """Run the enclosed copies on the copy stream, after event ``ready``."""
        raise NotImplementedError

    def keep_alive_for_copy(self, t: torch.Tensor) -> None:
        """Tell the allocator that the copy stream still reads ``t``."""

    def upload_mixed(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        host = self.host_buffer(max(total, _ALIGN), torch.uint8)
        view = host.numpy()
        for a, off in zip(arrays, offsets, strict=True):
            view[off : off + a.nbytes].view(a.dtype)[:] = a.reshape(-1)
        dev = torch.empty(host.shape, dtype=torch.uint8, device=self.device)
        dev.copy_(host, non_blocking=True)
        return [
            dev[off : off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, off in zip(arrays, offsets, strict=True)
        ]

    def copy_to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        ready = self.new_event()
        ready.record()
        host = self.host_buffer(t.numel(), t.dtype).view(t.shape)
        with self.copy_stream_ctx(ready):
            host.copy_(t, non_blocking=True)
            done = self.new_event(timing=True)
            done.record()
        self.keep_alive_for_copy(t)
        return host, done

    def timing_event(self):
        event = self.new_event(timing=True)
        event.record()
        return event


class CudaOps(AsyncOps):
    """The current CUDA device: pinned staging, a copy stream, CUDA events."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.copy_stream = torch.cuda.Stream(device)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def new_event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    @contextlib.contextmanager
    def copy_stream_ctx(self, ready: torch.cuda.Event):
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(ready)
            yield

    def keep_alive_for_copy(self, t: torch.Tensor) -> None:
        t.record_stream(self.copy_stream)


class Staged:
    """One host array of an ``UploadBatch``; ``dev`` is its device copy once the batch is uploaded."""

    __slots__ = ("host", "dev")

    def __init__(self, host: np.ndarray):
        self.host = host
        self.dev: torch.Tensor | None = None


class UploadBatch:
    """Host arrays from the parts of one step, copied to the device in one copy (docs/design.md, "Host work per step"):
    ``add`` returns a ``Staged`` handle whose ``dev`` is set by ``upload``."""

    def __init__(self) -> None:
        self._staged: list[Staged] = []

    def add(self, a: np.ndarray, dtype: type = np.int64) -> Staged:
        """Stage ``a`` cast to ``dtype`` (int64, int32 or float32; no copy if it has it); its ``dev`` is set by
        ``upload``."""
        s = Staged(np.asarray(a, dtype=dtype))
        self._staged.append(s)
        return s

    def upload(self, ops: DeviceOps) -> None:
        """Copy every staged array to the device in one transfer (none if nothing is staged)."""
        if self._staged:
            for s, d in zip(self._staged, ops.upload_mixed([s.host for s in self._staged]), strict=True):
                s.dev = d
            self._staged = []


def device_ops(device: torch.device) -> DeviceOps:
    """The ops for ``device``: ``CudaOps`` on CUDA, else synchronous ``DeviceOps``."""
    return CudaOps(device) if device.type == "cuda" else DeviceOps(device)


class DeviceClock:
    """Maps device events onto ``time.monotonic_ns()`` without waiting for the device.

    CUDA's ``elapsed_time`` is float32 milliseconds, so each step is timed against a reference at most one step old: an
    anchor recorded on an idle device, or the previous step's end event.
    """

    def __init__(self) -> None:
        self._ref = None
        self._ref_ns = 0

    @staticmethod
    def anchor(event) -> tuple[object, int]:
        """Record ``event`` now (the device must be idle) and pair it with the host time."""
        event.record()
        return event, time.monotonic_ns()

    def span(self, anchor: tuple[object, int] | None, start, end) -> tuple[int, int]:
        """Host times ``(start_ns, end_ns)`` of the next step's two completed events; ``anchor`` if launched on an idle
        device.

        Raises:
            RuntimeError: no anchor was ever given (the first step must have one).
        """
        if anchor is not None:
            self._ref, self._ref_ns = anchor
        if self._ref is None:
            raise RuntimeError("DeviceClock: the first timed step must carry an anchor")
        start_ns = self._ref_ns + round(self._ref.elapsed_time(start) * 1e6)
        end_ns = self._ref_ns + round(self._ref.elapsed_time(end) * 1e6)
        self._ref, self._ref_ns = end, end_ns
        return start_ns, end_ns
