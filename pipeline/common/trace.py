"""Step timeline: spans recorded by the processes on ``time.monotonic_ns()``, merged into a Chrome trace (Trace Event
Format, for Perfetto and chrome://tracing).

A span is ``(role, track, name, step_id, start_ns, end_ns, cpu_ns)``; ``cpu_ns`` is -1 except on the ``cpu`` track, the
whole process's CPU time per step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

Span = tuple[str, str, str, int, int, int, int]
# Processes in the order their tracks appear; worker ranks other than 0 are
# roles ``gpu_worker-tp<rank>`` (EngineConfig.worker_role).
ROLES = ("scheduler", "gpu_worker", "io_proc")


class TraceRecorder:
    """Collects spans in memory; ``dump`` writes them as a JSON list."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._last_step: tuple[int, int] | None = None  # (monotonic_ns, process CPU ns) at the previous step

    def add(self, role: str, track: str, name: str, step_id: int, start_ns: int, end_ns: int) -> None:
        self.spans.append((role, track, name, int(step_id), int(start_ns), int(end_ns), -1))

    def add_step_cpu(self, role: str, step_id: int) -> None:
        """Close step ``step_id`` of this process: a ``cpu`` span since the previous call (the first only starts the
        clock)."""
        now, cpu = time.monotonic_ns(), time.process_time_ns()
        if self._last_step is not None:
            start, cpu0 = self._last_step
            self.spans.append((role, "cpu", "step", int(step_id), start, now, cpu - cpu0))
        self._last_step = (now, cpu)

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.spans))


def load_spans(paths: list[str | Path]) -> list[Span]:
    """Spans from the files that exist among ``paths``."""
    out: list[Span] = []
    for p in paths:
        if Path(p).is_file():
            out.extend(tuple(s) for s in json.loads(Path(p).read_text()))
    return out


def chrome_trace(spans: list[Span]) -> dict:
    """Spans -> a Trace Event Format object, times relative to the first span."""
    t0 = min((s[4] for s in spans), default=0)
    tracks: dict[tuple[str, str], int] = {}
    events = []
    # One process track per role, the worker ranks (gpu_worker-tp1, ...) after gpu_worker.
    roles = sorted({*ROLES, *(s[0] for s in spans)}, key=lambda r: (ROLES.index(r.split("-")[0]), r))
    for pid, role in enumerate(roles, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": role}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
    for role, track, name, step, start, end, cpu in sorted(spans, key=lambda s: s[4]):
        pid = roles.index(role) + 1
        if cpu >= 0:
            events.append(
                {
                    "ph": "C",
                    "name": "CPU per step (us)",
                    "pid": pid,
                    "ts": (end - t0) / 1000,
                    "args": {"cpu_us": cpu / 1000},
                }
            )
            continue
        if (role, track) not in tracks:
            tracks[(role, track)] = tid = len([k for k in tracks if k[0] == role]) + 1
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}})
        events.append(
            {
                "ph": "X",
                "name": name,
                "pid": pid,
                "tid": tracks[(role, track)],
                "ts": (start - t0) / 1000,
                "dur": max(end - start, 0) / 1000,
                "args": {"step": step},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: list[Span], path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(spans)))


def device_spans(spans: list[Span]) -> np.ndarray:
    """``[N, 2]`` int64 (start_ns, end_ns) of the device spans, in step order."""
    dev = sorted((s[3], s[4], s[5]) for s in spans if s[0] == "gpu_worker" and s[1] == "device")
    return np.array([(a, b) for _, a, b in dev], dtype=np.int64).reshape(-1, 2)


def cpu_per_step_us(spans: list[Span]) -> dict[str, np.ndarray]:
    """Per role, the CPU microseconds its process spent per step (from the ``cpu`` track)."""
    out: dict[str, list[float]] = {}
    for s in spans:
        if s[6] >= 0:
            out.setdefault(s[0], []).append(s[6] / 1000)
    return {role: np.array(v) for role, v in out.items()}


def token_gaps_us(dev: np.ndarray) -> np.ndarray:
    """Token gaps in microseconds: start(N+1) − end(N) of consecutive device spans, clamped at 0 (CPU wall-time spans
    can touch)."""
    return np.maximum(dev[1:, 0] - dev[:-1, 1], 0) / 1000.0


def gap_metrics(dev: np.ndarray) -> dict:
    """Token gap (docs/design.md, "Measuring the token gap") and device-busy fraction over consecutive device spans:
    ``{"token_gap_us": {p50, p90, p99, max, mean}, "device_busy_fraction"}`` (gaps None below two steps)."""
    if len(dev) < 2:
        return {"token_gap_us": None, "device_busy_fraction": None}
    gaps = token_gaps_us(dev)
    busy = float((dev[:, 1] - dev[:, 0]).sum()) / float(dev[-1, 1] - dev[0, 0])
    return {
        "token_gap_us": {
            "p50": float(np.percentile(gaps, 50)),
            "p90": float(np.percentile(gaps, 90)),
            "p99": float(np.percentile(gaps, 99)),
            "max": float(gaps.max()),
            "mean": float(gaps.mean()),
        },
        "device_busy_fraction": min(busy, 1.0),
    }
