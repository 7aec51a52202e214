"""The worker's thread count follows the CPUs that other programs leave free."""

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pipeline.common.process import start_background_thread
from pipeline.gpu_worker.cpu_threads import ThreadGovernor, usable_cpus

HOG = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def test_usable_cpus_within_the_affinity():
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one for the other program")
def test_a_busy_cpu_takes_a_thread_away_and_the_checks_are_spaced():
    cpus = sorted(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(cpus[0])])
    try:
        governor = ThreadGovernor(len(cpus), time.monotonic_ns())
        assert torch.get_num_threads() == len(cpus)
        governor.check(time.monotonic_ns())  # too soon after the first look: nothing measured yet
        assert torch.get_num_threads() == len(cpus)
        time.sleep(0.6)
        governor.check(time.monotonic_ns())
        assert 1 <= torch.get_num_threads() <= len(cpus) - 1
    finally:
        hog.kill()
        hog.wait()
        torch.set_num_threads(before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one for the busy thread")
def test_a_busy_background_thread_of_the_engine_takes_a_thread_away():
    """A thread named by start_background_thread (grammar, encoding work beside the steps) counts as load."""
    cpus = sorted(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    stop = threading.Event()
    with ThreadPoolExecutor(1, initializer=start_background_thread, initargs=("busy",)) as pool:
        pool.submit(lambda: None).result()  # the thread exists and is named
        try:
            governor = ThreadGovernor(len(cpus), time.monotonic_ns())
            pool.submit(_spin, stop)
            for _ in range(3):  # the first look at a new thread does not trust its name yet
                time.sleep(0.3)
                governor.check(time.monotonic_ns())
            assert 1 <= torch.get_num_threads() <= len(cpus) - 1
        finally:
            stop.set()
            torch.set_num_threads(before)


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        pass
