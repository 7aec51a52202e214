"""gpu_worker: the only process that touches the device.

Loop: publish every step whose tokens reached the host, then launch the next StepDescriptor (or wait for the oldest step
when the scheduler's in-flight count is reached); on CUDA, step N+1 launches while N runs.
"""

from __future__ import annotations

import logging
import re
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING

import msgspec
import torch

from pipeline.common.config import EngineConfig
from pipeline.common.constants import POLL_INTERVAL_S
from pipeline.common.heartbeat import Heartbeats
from pipeline.common.process import StopFlag, Stopped, freeze_startup_heap, report
from pipeline.common.shm_ring import RingTimeout, ShmRing
from pipeline.common.step_clock import WorkerClock
from pipeline.common.step_output import StepOutput
from pipeline.common.step_protocol import MAX_INFLIGHT_STEPS, StepDescriptor, TokenMasks, read_descriptor
from pipeline.common.trace import TraceRecorder
from pipeline.gpu_worker.attention import make_backend
from pipeline.gpu_worker.cpu_threads import ThreadGovernor, usable_cpus
from pipeline.gpu_worker.executor import ModelExecutor, SimExecutor
from pipeline.gpu_worker.launched_step import LaunchedStep
from pipeline.gpu_worker.model_runner import ModelRunner
from pipeline.gpu_worker.sampling.mask_reader import MaskReader
from pipeline.gpu_worker.sim_device import SimulatedDevice
from pipeline.gpu_worker.step_shapes import StepShapeRecorder

if TYPE_CHECKING:  # importing it loads transformers, which a single simulated rank never needs
    from pipeline.gpu_worker.distributed import DescriptorRelay

# While a launched step runs on the device, look for the next descriptor this often.
_BUSY_POLL_S = 0.0002


class WorkerProc:
    """Owns the model runner and its rings; ``run`` is the process body (docs/design.md, "Parallelism").

    With ``config.trace`` it records ``prepare``, ``launch`` and ``device`` spans per step. Every tensor-parallel rank
    runs this loop on the same descriptors; only rank 0 publishes StepOutputs and relays descriptors to other nodes.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        desc_ring: ShmRing[StepDescriptor] | None,
        out_ring: ShmRing[StepOutput] | None,
        rank: int = 0,
        relay: DescriptorRelay | None = None,
        heartbeats: Heartbeats | None = None,
        mask_ring: ShmRing[TokenMasks] | None = None,
    ):
        self.config, self.runner, self.rank = config, runner, rank
        self.mask_ring = mask_ring
        self.role = config.worker_role(rank)
        self.heartbeats = heartbeats
        self.desc_ring, self.out_ring, self.relay = desc_ring, out_ring, relay
        self.pending: deque[LaunchedStep] = deque()
        # With this many steps pending the scheduler has its in-flight limit out: no descriptor comes
        # before the oldest one's output.
        self.max_pending = MAX_INFLIGHT_STEPS if config.scheduler.async_scheduling else 1
        self.clock = WorkerClock() if out_ring is not None else None
        self.trace = TraceRecorder() if config.trace else None
        # Every rank runs the same steps: rank 0's record is the step list.
        self.step_shapes = StepShapeRecorder() if config.step_shapes_file and rank == 0 else None
        # A model on the CPU with automatic threads: fewer while other programs contend for the CPUs.
        auto = config.device == "cpu" and not config.is_simulated and not config.worker.worker_threads
        self.threads = ThreadGovernor(usable_cpus(), time.monotonic_ns()) if auto else None

    def run(self, stop: StopFlag) -> None:
        """Run steps until ``stop.is_set()`` or, on a node other than the head, until rank 0 stops.

        Raises:
            Exception: whatever a launch raised (a failing forward, ``StaleTokenError``); the process exits with 1.
        """
        self.runner.masks = MaskReader(self.mask_ring, self.rank, stop, self.relay)
        try:
            self._run(stop)
        except Stopped:  # stopped while a step waited for its masks
            pass

    def _run(self, stop: StopFlag) -> None:
        while not stop.is_set():
            if self.heartbeats is not None:
                self.heartbeats.beat(self.role)
            if self.threads is not None:
                self.threads.check(time.monotonic_ns())
            self._publish_done(stop)
            if len(self.pending) >= self.max_pending:
                self.pending[0].wait()  # its output is what the next descriptor waits for
                continue
            timeout = _BUSY_POLL_S if self.pending else POLL_INTERVAL_S
            if self.desc_ring is None:  # a rank on another node
                desc = self.relay.receive(timeout)
                if self.relay.head_stopped:
                    return
                if desc is None:
                    continue
                t0 = time.monotonic_ns()
                inputs = read_descriptor(desc)
            else:
                try:
                    desc = self.desc_ring.acquire_read(self.rank, timeout=timeout)
                except RingTimeout:
                    desc = None
                if desc is None:
                    if self.relay is not None:
                        self.relay.heartbeat()
                    continue
                t0 = time.monotonic_ns()
                if self.relay is not None:
                    self.relay.send(desc)
                inputs = read_descriptor(desc)
                self.desc_ring.release_read(self.rank)
            if inputs.step_id == self.config.debug_fail_step:
                raise RuntimeError(f"injected fault: the forward pass of step {inputs.step_id} failed")
            if self.step_shapes is not None:
                self.step_shapes.add(inputs)
            launched = self.runner.launch(inputs, t0, lambda: self._publish_done(stop))
            launched.continues = inputs.continues
            self.pending.append(launched)

    def _publish_done(self, stop: StopFlag) -> None:
        while self.pending and self.pending[0].is_done():
            self._publish(self.runner.finish(self.pending.popleft()), stop)

    def _publish(self, step: LaunchedStep, stop: StopFlag) -> None:
        """Write ``step``'s sampled tokens and log-probabilities into the output ring (rank 0; others trace)."""
        if self.clock is not None:
            self.clock.step(step.device_start_ns, step.device_end_ns, step.continues)
        while self.out_ring is not None:
            try:
                out = self.out_ring.acquire_write(timeout=POLL_INTERVAL_S)
            except RingTimeout:  # io_proc or the scheduler has not read the oldest output yet
                if stop.is_set():
                    return
                if self.heartbeats is not None:
                    self.heartbeats.beat(self.role)
                continue
            out.write(
                step.step_id,
                step.req_num,
                step.tokens.numpy(),
                step.logprobs,
                step.prompt_logprobs,
                step.device_end_ns or time.monotonic_ns(),
                step.continues,
                self.clock.values,
                step.draft_matched,
                step.failed,
                step.proposals,
                step.failed_why,
            )
            self.out_ring.publish()
            break
        if self.trace is not None:
            s, role = step.step_id, self.role
            self.trace.add(role, "host", "prepare", s, step.prepare_start_ns, step.prepare_end_ns)
            self.trace.add(role, "host", "launch", s, step.prepare_end_ns, step.launch_ns)
            self.trace.add(role, "device", "step", s, step.device_start_ns, step.device_end_ns)
            self.trace.add_step_cpu(role, s)

    def close(self) -> None:
        """Write the trace and step shapes (if recording) and detach from the rings."""
        if self.trace is not None:
            self.trace.dump(self.config.trace_path(self.role))
        if self.step_shapes is not None:
            self.step_shapes.save(self.config.step_shapes_file)
        if self.relay is not None and self.rank == 0:
            self.relay.send_stop()
        if self.desc_ring is not None:
            self.desc_ring.close()
        if self.mask_ring is not None:
            self.mask_ring.close()
        if self.out_ring is not None:
            self.out_ring.close()
        if self.heartbeats is not None:
            self.heartbeats.close()


def load_runner(config: EngineConfig, rank: int = 0) -> tuple[ModelRunner, DescriptorRelay | None]:
    """Load ``config``'s model (rank ``rank``'s shard) and build its runner; with tensor parallelism, returns once every
    rank has joined, with the descriptor relay over several nodes (else None).

    Raises:
        ValueError: the model cannot be loaded as configured, or another node's settings differ from the head's.
        RuntimeError: the rendezvous failed.
    """
    device = torch.device("cuda", config.device_index(rank)) if config.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, config.dtype)
    if config.is_simulated:
        # The host side of a step is small tensor work: extra intra-op
        # threads would only spin and take a core from the other processes.
        torch.set_num_threads(1)
        sim = SimulatedDevice(config.worker.sim_step_us, config.worker.sim_token_us)
        # Simulated ranks run no collectives; over several nodes they still
        # need the process group for the relay.
        relay = None
        if config.parallel.nnodes > 1:
            from pipeline.gpu_worker.distributed import init_tensor_parallel

            relay = init_tensor_parallel(config, rank)[1]
        return ModelRunner(config, SimExecutor(sim, make_backend(config.worker.attention_backend)), device), relay
    torch.set_num_threads(config.worker.worker_threads or usable_cpus())
    from pipeline.gpu_worker.layers.tp import SINGLE_RANK
    from pipeline.gpu_worker.models.loader import load_model
    from pipeline.gpu_worker.models.quantized import describe

    tp, relay = SINGLE_RANK, None
    if config.parallel.tensor_parallel_size > 1:
        from pipeline.gpu_worker.distributed import init_tensor_parallel

        tp, relay = init_tensor_parallel(config, rank)
    model = load_model(
        config.model, dtype, device, config.worker.attention_backend, tp, config.max_model_len, config.quantization
    )
    logging.getLogger(__name__).info("%s", describe(model))
    draft = None
    if config.speculative is not None and config.speculative.method == "draft_model":
        draft = load_model(
            config.speculative.model, dtype, device, config.worker.attention_backend, tp, config.max_model_len
        )
    if not config.num_kv_blocks:
        from pipeline.gpu_worker.kv_cache_size import kv_cache_blocks

        blocks = kv_cache_blocks(config, model, device, dtype, tp, draft)
        config = msgspec.structs.replace(config, num_kv_blocks=blocks)
    executor = ModelExecutor(config, model, device, dtype)
    if config.lora is not None:
        from pipeline.gpu_worker.lora.worker import LoraWorker

        executor.lora = LoraWorker(model, config.lora, config.scheduler.max_num_seqs, config.ipc_dir)
    runner = ModelRunner(config, executor, device, draft_model=draft)
    if config.worker.cuda_graph_sizes:  # after the KV cache exists, so the graphs' pool comes from what is left
        runner.executor.capture_decode_graphs(runner.input_batch.block_table, config.worker.cuda_graph_sizes)
    # Before "ready": /health says 200 once a request can be served at full speed (docs/design.md, "Readiness").
    runner.executor.warm_up(runner.ops.upload)
    return runner, relay


def run_gpu_worker(config: EngineConfig, status_conn, stop: StopFlag, rank: int = 0) -> int:
    """Process body of gpu_worker rank ``rank`` (see ``pipeline.child``): run steps until ``stop``; returns the exit
    status."""
    role = config.worker_role(rank)
    # The rings live on the head node; ranks elsewhere get the descriptors from the relay.
    desc_ring = config.descriptor_ring() if config.is_head else None
    mask_ring = config.mask_ring() if config.is_head else None
    out_ring = config.output_ring() if rank == 0 else None
    heartbeats = config.heartbeats() if config.is_head else None
    report(status_conn, "attached", role)
    try:
        with stop.interrupting():
            runner, relay = load_runner(config, rank)
    except Stopped:
        return 0  # stopped while loading: the model is not needed any more
    except (ValueError, FileNotFoundError) as e:  # the model cannot run as configured: the message says why
        report(status_conn, "error", role, f"could not load model {config.model!r}: {e}")
        return 1
    except Exception as e:  # start-up failure: tell the launcher why, then exit
        traceback.print_exc()
        report(status_conn, "error", role, f"could not load model {config.model!r}: {e}")
        return 1
    freeze_startup_heap()
    if not config.num_kv_blocks and rank == 0:  # the launcher starts the scheduler with this figure
        report(status_conn, "kv_blocks", role, runner.config.num_kv_blocks)
    report(status_conn, "ready", role)
    proc = WorkerProc(runner.config, runner, desc_ring, out_ring, rank, relay, heartbeats, mask_ring)
    try:
        proc.run(stop)
        if relay is not None and relay.head_stopped:
            report(status_conn, "done", role, "the head node stopped")
    except RuntimeError as e:
        if config.parallel.nnodes == 1:
            raise
        # A relay or model collective with another node's ranks failed:
        # their process died or the network is down. Tell the launcher in
        # one line; the traceback stays on stderr.
        traceback.print_exc()
        # gloo's messages start with its source location; the first sentence says what happened.
        why = re.sub(r"^\[[^\]]*\]\s*", "", str(e)).split(". ")[0] or type(e).__name__
        report(status_conn, "error", role, f"lost the tensor-parallel ranks on another node ({why})")
        return 1
    finally:
        proc.close()
    return 0
