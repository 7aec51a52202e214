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
from pipeline.common.constants import POLL_INTERVAL_S
from pipeline.common.process import StopFlag, Stopped, report
from pipeline.common.shm_ring import RingTimeout, ShmRing
from pipeline.common.step_protocol import DESCRIPTOR_READER_WORKER, StepDescriptor, StepOutput, read_descriptor
from pipeline.common.trace import TraceRecorder
from pipeline.gpu_worker.executor import ModelExecutor, SimExecutor
from pipeline.gpu_worker.model_runner import LaunchedStep, ModelRunner
from pipeline.gpu_worker.sim_device import SimulatedDevice

# While a launched step runs on the device, look for the next descriptor this often.
_BUSY_POLL_S = 0.0002


class WorkerProc:
    """Owns the model runner and both rings; :meth:`run` is the process body.

    With ``config.trace`` it records, per step, the host spans ``prepare``
    (descriptor read to inputs ready) and ``launch`` (inputs ready to the
    step enqueued) and the ``device`` span, and writes them to
    ``config.trace_path("gpu_worker")`` in :meth:`close`.
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner, desc_ring: ShmRing[StepDescriptor],
                 out_ring: ShmRing[StepOutput]):
        self.config, self.runner = config, runner
        self.desc_ring, self.out_ring = desc_ring, out_ring
        self.pending: deque[LaunchedStep] = deque()
        self.trace = TraceRecorder() if config.trace else None

    def run(self, stop: StopFlag) -> None:
        """Run steps until ``stop.is_set()``.

        Raises:
            Exception: whatever a launch raised (a failing forward pass,
                ``StaleTokenError``); the process reports it and exits with 1.
        """
        while not stop.is_set():
            while self.pending and self.pending[0].is_done():
                self._publish(self.runner.finish(self.pending.popleft()), stop)
            try:
                desc = self.desc_ring.acquire_read(DESCRIPTOR_READER_WORKER,
                                                   timeout=_BUSY_POLL_S if self.pending else POLL_INTERVAL_S)
            except RingTimeout:
                continue
            t0 = time.monotonic_ns()
            inputs = read_descriptor(desc)
            self.desc_ring.release_read(DESCRIPTOR_READER_WORKER)
            if inputs.step_id == self.config.debug_fail_step:
                raise RuntimeError(f"injected fault: the forward pass of step {inputs.step_id} failed")
            self.pending.append(self.runner.launch(inputs, t0))

    def _publish(self, step: LaunchedStep, stop: StopFlag) -> None:
        """Write ``step``'s sampled tokens into the output ring."""
        while True:
            try:
                out = self.out_ring.acquire_write(timeout=POLL_INTERVAL_S)
                break
            except RingTimeout:
                if stop.is_set():
                    return
        out.write(step.step_id, step.req_num, step.tokens.numpy())
        self.out_ring.publish()
        if self.trace is not None:
            s = step.step_id
            self.trace.add("gpu_worker", "host", "prepare", s, step.prepare_start_ns, step.prepare_end_ns)
            self.trace.add("gpu_worker", "host", "launch", s, step.prepare_end_ns, step.launch_ns)
            self.trace.add("gpu_worker", "device", "step", s, step.device_start_ns, step.device_end_ns)
            self.trace.add_step_cpu("gpu_worker", s)

    def close(self) -> None:
        """Write the trace (if recording) and detach from the rings."""
        if self.trace is not None:
            self.trace.dump(self.config.trace_path("gpu_worker"))
        self.desc_ring.close()
        self.out_ring.close()


def load_runner(config: EngineConfig) -> ModelRunner:
    """Load the model named by ``config`` and build its runner."""
    device = torch.device(config.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
    if config.is_simulated:
        # The host side of a step is small tensor work: extra intra-op
        # threads would only spin and take a core from the other processes.
        torch.set_num_threads(1)
        return ModelRunner(config, SimExecutor(SimulatedDevice(config.sim_step_us, config.sim_token_us)), device)
    from pipeline.gpu_worker.weights import load_model
    model = load_model(config.model, dtype, device)
    return ModelRunner(config, ModelExecutor(config, model, device, dtype), device)


def run_gpu_worker(config: EngineConfig, status_conn, stop: StopFlag) -> int:
    """Process body of gpu_worker (see :mod:`pipeline.child`): run steps until ``stop``; returns the exit status."""
    desc_ring = config.descriptor_ring()
    out_ring = config.output_ring()
    report(status_conn, "attached", "gpu_worker")
    try:
        with stop.interrupting():
            runner = load_runner(config)
    except Stopped:
        return 0  # stopped while loading: the model is not needed any more
    except Exception as e:  # start-up failure: tell the launcher why, then exit
        traceback.print_exc()
        report(status_conn, "error", "gpu_worker", f"could not load model {config.model!r}: {e}")
        return 1
    report(status_conn, "ready", "gpu_worker")
    proc = WorkerProc(config, runner, desc_ring, out_ring)
    try:
        proc.run(stop)
    finally:
        proc.close()
    return 0
