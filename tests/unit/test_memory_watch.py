"""BurstWatch and HeapWatch: true once a burst has passed and stayed passed for their settle time."""

import time

from pipeline.common.memory import BurstWatch, HeapWatch


def test_burst_watch_fires_once_after_the_count_stays_down():
    w = BurstWatch(threshold=8, settle_s=0.05)
    assert not any(w.passed(n) for n in (1, 4, 7, 3, 1))  # never a burst
    assert not w.passed(16)
    assert not w.passed(5)  # above a quarter of the peak
    assert not w.passed(2)  # down, not yet settled
    time.sleep(0.06)
    assert w.passed(2)
    time.sleep(0.06)
    assert not w.passed(2)  # once per burst: the peak restarted from 2


def test_heap_watch_fires_once_after_the_heap_stays_down():
    w = HeapWatch(min_bytes=100, settle_s=0.05)
    assert not w.passed(None)
    assert not w.passed(1000)
    assert not w.passed(950)  # not far enough below the peak
    assert not w.passed(800)
    assert not w.passed(1000)  # back up: the wait starts again
    assert not w.passed(800)
    time.sleep(0.06)
    assert w.passed(800)
    time.sleep(0.06)
    assert not w.passed(800)
