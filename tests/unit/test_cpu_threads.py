"""The worker's thread count follows the CPUs that other programs leave free."""

import os
import subprocess
import sys
import time

import pytest
import torch

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
