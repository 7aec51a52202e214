"""``pipeline-serve``: create the rings, start the three processes, watch them.

The launcher owns the lifecycle (docs/design.md, "Processes and lifecycle"):
it creates every shared-memory ring, starts io_proc, scheduler_proc and
gpu_worker, unlinks the rings as soon as all three have attached (so the kernel frees them however the
processes end), and stops everyone on a signal or on the death of any child.
With ``--nnodes > 1`` a launcher on a node other than the head starts only
that node's worker ranks (docs/design.md, "Parallelism").
The flags and the config they make are in :mod:`pipeline.server_args`,
``--profile``'s py-spy recording in :mod:`pipeline.profiler`.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import signal
import sys
import time
from multiprocessing.connection import wait

from pipeline.common.config import EngineConfig
from pipeline.common.shm_ring import ShmRing
from pipeline.common.trace import ROLES, load_spans, write_chrome_trace
from pipeline.profiler import Profiler
from pipeline.server_args import build_parser, make_config

_STOP_GRACE_S = 5.0


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


class ChildFailed(Exception):
    """A child process died or reported a start-up error; the message says which and why."""


class HeadStopped(Exception):
    """On a node other than the head: a worker rank ended because the head node's server stopped."""


class Launcher:
    """Starts, watches and stops the processes of one server instance.

    Args:
        config: the instance's configuration.
        roles: which processes to start; a benchmark that plays io_proc's
            part in-process starts only the scheduler and the worker.
            ``"scheduler"`` starts one per data-parallel engine, and
            ``"gpu_worker"`` one per engine and tensor-parallel rank. On a
            node other than the head (``config.is_head`` false) only the
            node's worker ranks start, and no ring is created.
        trace_file: write the merged Chrome trace here on stop.
        profile_dir: record each process with py-spy; flame graphs land here on stop.

    With ``config.trace``, :meth:`stop` loads the spans every role wrote to
    ``config.trace_path(role)`` into ``spans`` (a benchmark playing io_proc's
    part writes io_proc's file itself, before calling stop).
    """

    def __init__(self, config: EngineConfig, roles: tuple[str, ...] = ROLES,
                 trace_file: str | None = None, profile_dir: str | None = None):
        from pipeline.gpu_worker.main import run_gpu_worker
        from pipeline.io_proc.main import run_io_proc
        from pipeline.scheduler_proc.main import run_scheduler

        self.config, self.trace_file = config, trace_file
        engines = config.engines()
        if not config.is_head:
            roles = ("gpu_worker",)
        # Each engine's descriptor ring, then its output ring; only the head node has them.
        self.rings = [ring for e in engines if config.is_head
                      for ring in (e.descriptor_ring(create=True), e.output_ring(create=True))]
        ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.Process] = {}
        self.conns = {}

        def add(name: str, target, engine: EngineConfig, *args) -> None:
            parent, child = ctx.Pipe(duplex=False)
            self.procs[name] = ctx.Process(target=target, args=(engine, child, *args), name=f"pipeline-{name}")
            self.conns[name] = parent

        for e in engines:
            if "scheduler" in roles:
                add(e.scheduler_role, run_scheduler, e)
            if "gpu_worker" in roles:  # tensor parallelism: one process per rank, each told its rank
                for rank in config.local_ranks:
                    add(e.worker_role(rank), run_gpu_worker, e, rank)
        if "io_proc" in roles:  # one for all engines
            add("io_proc", run_io_proc, config)
        self.profiler = Profiler(profile_dir) if profile_dir else None
        self.spans: list = []
        self._signalled = False

    @property
    def output_rings(self) -> list[ShmRing]:
        """The launcher's handles on the engines' StepOutput rings, for a benchmark that plays io_proc's part."""
        return self.rings[1::2]

    def start(self, timeout: float = 600.0) -> None:
        """Start every process and wait until all are ready.

        Raises:
            ChildFailed: a process died or reported an error first.
            TimeoutError: not ready within ``timeout`` seconds.
        """
        for p in self.procs.values():
            p.start()
        attached, ready = set(), set()
        deadline = time.monotonic() + timeout
        while len(ready) < len(self.procs):
            if self._signalled:
                raise ChildFailed("interrupted during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes not ready after {timeout:.0f} s: {sorted(set(self.procs) - ready)}")
            self._check_alive()
            for conn in wait(list(self.conns.values()), timeout=0.5):
                try:
                    kind, name, *rest = conn.recv()
                except EOFError:
                    continue  # its death shows up in _check_alive
                if kind == "attached":
                    attached.add(name)
                    if len(attached) == len(self.procs):
                        for ring in self.rings:
                            ring.unlink()  # every process has mapped them: nothing can leak now
                elif kind == "ready":
                    ready.add(name)
                elif kind == "error":
                    raise ChildFailed(f"{name}: {rest[0]}")
        if self.profiler:
            self.profiler.start({name: p.pid for name, p in self.procs.items()})

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.exitcode is not None or (p.pid is not None and not p.is_alive()):
                p.join(1.0)  # reap it so exitcode is set
                kind, why = self._last_report(name)
                if kind == "done" and p.exitcode == 0:
                    raise HeadStopped(f"{name}: {why}")
                raise ChildFailed(f"{name} {_exit_description(p.exitcode)}" + (f": {why}" if why else ""))

    def _last_report(self, name: str) -> tuple[str, str]:
        """What a dead child said last after start-up: ``("error", why)`` (a worker that lost another
        node's ranks), ``("done", why)`` (a rank whose head node stopped), or ``("", "")``."""
        last, conn = ("", ""), self.conns[name]
        try:
            while conn.poll():
                kind, _, *rest = conn.recv()
                if kind in ("error", "done"):
                    last = (kind, rest[0])
        except (EOFError, OSError):
            pass
        return last

    def _on_signal(self, *_args) -> None:
        self._signalled = True

    def serve(self) -> int:
        """``pipeline-serve``'s body: start, watch until a signal or a death; returns the exit code."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        t0 = time.monotonic()
        try:
            self.start()
            c = self.config
            if c.is_head:
                print(f"pipeline-serve: serving {c.served_model_name!r} on http://{c.host}:{c.port} "
                      f"(async scheduling {'on' if c.async_scheduling else 'off'}, "
                      f"{'simulated device' if c.is_simulated else c.device + ', ' + c.dtype}; "
                      f"ready in {time.monotonic() - t0:.1f} s)", flush=True)
            else:
                print(f"pipeline-serve: node {c.node_rank} of {c.nnodes} running tensor-parallel ranks "
                      f"{c.local_ranks.start}-{c.local_ranks.stop - 1} of {c.tensor_parallel_size} for the head at "
                      f"{c.master_addr}:{c.master_port} (ready in {time.monotonic() - t0:.1f} s)", flush=True)
            sentinels = [p.sentinel for p in self.procs.values()]
            while not self._signalled:
                if wait(sentinels, timeout=0.5):
                    self._check_alive()
            return 0
        except HeadStopped as e:
            print(f"pipeline-serve: {e}; stopping this node", file=sys.stderr)
            return 0
        except ChildFailed as e:
            if self._signalled:
                return 0
            print(f"pipeline-serve: {e}; stopping the server", file=sys.stderr)
            return 1
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL after a grace period), then clean up.

        Writes the trace and the flame graphs if asked for, unlinks the rings
        (a no-op once they were unlinked at start-up) and removes the socket directory.
        """
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in self.procs.values():
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join()
        for ring in self.rings:
            ring.unlink()
            ring.close()
        if self.profiler:
            self.profiler.finish()
        if self.config.trace:
            # io_proc's file too when a benchmark played its part in-process.
            self.spans = load_spans([self.config.trace_path(r) for r in dict.fromkeys([*ROLES, *self.procs])])
            if self.trace_file:
                write_chrome_trace(self.spans, self.trace_file)
                print(f"pipeline: wrote step timeline to {self.trace_file} (open it in https://ui.perfetto.dev)",
                      file=sys.stderr)
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """Console entry of ``pipeline-serve``."""
    args = build_parser().parse_args(argv)
    config = make_config(args)
    code = Launcher(config, trace_file=args.trace, profile_dir=args.profile).serve()
    if code == 0:
        print("pipeline-serve: stopped", file=sys.stderr)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
