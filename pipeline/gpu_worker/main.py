"""gpu_worker: the only process that touches the device.

Loop: publish every launched step whose tokens have reached the host, then
take the next StepDescriptor and launch it. With a CUDA device, step N+1 is
launched while N still runs (the scheduler queues it ahead), so the device
never waits for the host; on CPU torch each launch runs to completion, and
the overlap is the scheduler planning N+1 during N's forward.
"""

from __future__ import annotations

import time
import traceback
from collections import deque

import torch

from pipeline.common.config import EngineConfig
from pipeline.common.layouts import (
    OUT_DEVICE_END_NS, OUT_DEVICE_START_NS, OUT_LAUNCH_NS, OUT_NUM_ROWS, OUT_PREPARE_END_NS,
    OUT_PREPARE_START_NS, OUT_PUBLISH_NS, OUT_STEP_ID,
)
from pipeline.common.process import child_setup, report
from pipeline.common.shm_ring import RingTimeout, ShmRing
from pipeline.gpu_worker.model_runner import LaunchedStep, ModelRunner, read_descriptor
from pipeline.gpu_worker.sim_device import SimulatedDevice

_IDLE_POLL_S = 0.2
# While a launched step runs on the device, look for the next descriptor this often.
_BUSY_POLL_S = 0.0002


def publish(out_ring: ShmRing, step: LaunchedStep, stop) -> None:
    """Write ``step``'s sampled tokens and timings into the output ring."""
    while True:
        try:
            out = out_ring.acquire_write(timeout=_IDLE_POLL_S)
            break
        except RingTimeout:
            if stop.is_set():
                return
    n = len(step.req_num)
    h = out["header"]
    h[OUT_STEP_ID], h[OUT_NUM_ROWS] = step.step_id, n
    h[OUT_PREPARE_START_NS], h[OUT_PREPARE_END_NS], h[OUT_LAUNCH_NS] = \
        step.prepare_start_ns, step.prepare_end_ns, step.launch_ns
    h[OUT_DEVICE_START_NS], h[OUT_DEVICE_END_NS] = step.device_start_ns, step.device_end_ns
    out["req_num"][:n] = step.req_num
    out["token_id"][:n] = step.tokens.numpy()
    h[OUT_PUBLISH_NS] = time.monotonic_ns()
    out_ring.publish()


def serve(runner: ModelRunner, desc_ring: ShmRing, out_ring: ShmRing, stop) -> None:
    """Run steps until ``stop.is_set()``."""
    pending: deque[LaunchedStep] = deque()
    while not stop.is_set():
        while pending and pending[0].is_done():
            publish(out_ring, runner.finish(pending.popleft()), stop)
        try:
            desc = desc_ring.acquire_read(0, timeout=_BUSY_POLL_S if pending else _IDLE_POLL_S)
        except RingTimeout:
            continue
        inputs = read_descriptor(desc)
        desc_ring.release_read(0)
        pending.append(runner.launch(inputs))


def load_runner(config: EngineConfig) -> ModelRunner:
    """Load the model named by ``config`` and build its runner."""
    device = torch.device(config.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
    if config.is_simulated:
        # The host side of a step is small tensor work: extra intra-op
        # threads would only spin and take a core from the other processes.
        torch.set_num_threads(1)
        return ModelRunner(config, SimulatedDevice(config.sim_step_us, config.sim_token_us), device, dtype)
    from pipeline.gpu_worker.weights import load_model
    return ModelRunner(config, load_model(config.model, dtype, device), device, dtype)


def run_gpu_worker(config: EngineConfig, status_conn) -> None:
    """Process entry of gpu_worker (see :mod:`pipeline.common.process`)."""
    stop = child_setup("gpu_worker")
    desc_ring = config.descriptor_ring()
    out_ring = config.output_ring()
    report(status_conn, "attached", "gpu_worker")
    try:
        runner = load_runner(config)
    except Exception as e:  # start-up failure: tell the launcher why, then exit
        traceback.print_exc()
        report(status_conn, "error", "gpu_worker", f"could not load model {config.model!r}: {e}")
        raise SystemExit(1)
    report(status_conn, "ready", "gpu_worker")
    try:
        serve(runner, desc_ring, out_ring, stop)
    finally:
        desc_ring.close()
        out_ring.close()
