"""Device-to-host time mapping keeps microsecond token gaps after hours of uptime."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.gpu_worker.device import DeviceClock


class TimedEvent:
    """A completed CUDA event at device time ``t_ns``; ``elapsed_time`` is float32 ms, as CUDA's."""

    def __init__(self, t_ns: int):
        self.t_ns = t_ns

    def elapsed_time(self, other: TimedEvent) -> float:
        return float(np.float32((other.t_ns - self.t_ns) / 1e6))


def run(steps: list[tuple[int, int, bool]]) -> list[tuple[int, int]]:
    """Map ``(start_ns, end_ns, anchored)`` device spans; the device clock equals the host clock.

    An anchored step was launched on an idle device: its anchor event ran
    when it was recorded, 5 us before the step started.
    """
    clock, out = DeviceClock(), []
    for start, end, anchored in steps:
        anchor = (TimedEvent(start - 5_000), start - 5_000) if anchored else None
        out.append(clock.span(anchor, TimedEvent(start), TimedEvent(end)))
    return out


def busy_hour(step_ns: int = 100_000_000, gap_ns: int = 3_000) -> list[tuple[int, int, bool]]:
    """An hour of back-to-back steps with a 3 us gap; only the very first launch found the device idle."""
    steps, t = [], 1_000_000
    while t < 3600 * 10**9:
        duration = step_ns + (len(steps) % 7) * 1_000  # steps vary a little
        steps.append((t, t + duration, not steps))
        t = steps[-1][1] + gap_ns
    return steps


def test_gaps_stay_exact_after_an_hour_busy():
    steps = busy_hour()
    mapped = run(steps)
    true_gaps = np.array([b[0] - a[1] for a, b in zip(steps, steps[1:])])
    gaps = np.array([b[0] - a[1] for a, b in zip(mapped, mapped[1:])])
    assert np.abs(gaps - true_gaps).max() <= 1_000  # 1 us, over 36,000 steps
    assert abs(mapped[-1][1] - steps[-1][1]) < 1_000_000  # absolute drift well under 1 ms

    # What timing everything against the start-up event gives instead.
    ref = TimedEvent(steps[0][0] - 5_000)
    naive = [
        (
            ref.t_ns + round(ref.elapsed_time(TimedEvent(s)) * 1e6),
            ref.t_ns + round(ref.elapsed_time(TimedEvent(e)) * 1e6),
        )
        for s, e, _ in steps[-100:]
    ]
    naive_gaps = np.array([b[0] - a[1] for a, b in zip(naive, naive[1:])])
    assert np.abs(naive_gaps - true_gaps[-99:]).max() > 10_000


def test_reanchoring_after_idle_is_exact():
    steps = [
        (1_000_000, 11_000_000, True),
        (11_004_000, 21_000_000, False),
        (3_600 * 10**9, 3_600 * 10**9 + 10_000_000, True),
    ]  # an hour idle, then a new anchor
    assert run(steps) == [(s, e) for s, e, _ in steps]


def test_first_step_needs_an_anchor():
    with pytest.raises(RuntimeError, match="anchor"):
        DeviceClock().span(None, TimedEvent(0), TimedEvent(1))
