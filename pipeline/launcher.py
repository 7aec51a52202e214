"""``pipeline-serve``: create the rings, start the three processes, watch them (docs/design.md, "Processes and
lifecycle"; "Parallelism")."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait

import msgspec

import pipeline
from pipeline.common.config import EngineConfig
from pipeline.common.instance_files import remove_files_of
from pipeline.common.process import exit_now
from pipeline.common.shm_ring import ShmRing
from pipeline.common.trace import ROLES, load_spans, write_chrome_trace
from pipeline.profiler import Profiler
from pipeline.server_args import build_parser
from pipeline.server_config import make_config

_STOP_GRACE_S = 5.0
_WATCHDOG_GRACE_S = 0.5  # docs/design.md, "Liveness"


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


class ChildFailed(Exception):
    """A child process died or reported an error; the message says which and why."""


class _Child(subprocess.Popen):
    """One child process (``python -m pipeline.child``) and a pidfd that becomes readable when it exits."""

    @classmethod
    def start(cls, kind: str, config: EngineConfig, rank: int = 0) -> tuple[_Child, Connection]:
        """Start a process of ``kind`` (io_proc, scheduler, gpu_worker rank ``rank``); returns it and its status pipe's
        read end. The config goes over its stdin."""
        status_r, status_w = os.pipe()
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(pipeline.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            child = cls(
                [sys.executable, "-m", "pipeline.child", kind, str(status_w), str(os.getpid()), str(rank)],
                stdin=subprocess.PIPE,
                pass_fds=(status_w,),
                env=env,
            )
        finally:
            os.close(status_w)
        child.sentinel = os.pidfd_open(child.pid)
        try:
            child.stdin.write(msgspec.json.encode(config.for_process(kind)))
            child.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: _check_alive reports it
        return child, Connection(status_r, writable=False)

    def close(self) -> None:
        """Release the pidfd (after the child was reaped)."""
        os.close(self.sentinel)


class HeadStopped(Exception):
    """On a node other than the head: a worker rank ended because the head node's server stopped."""


class Launcher:
    """Starts, watches and stops the processes of one server instance; ``roles`` lets a benchmark play io_proc
    in-process."""

    def __init__(
        self,
        config: EngineConfig,
        roles: tuple[str, ...] = ROLES,
        trace_file: str | None = None,
        profile_dir: str | None = None,
    ):
        self.config, self.trace_file = config, trace_file
        self.roles = roles if config.is_head else ("gpu_worker",)
        # Each engine's descriptor ring, mask ring (with a vocabulary) and output ring; only the head node has them.
        engines = config.engines() if config.is_head else []
        self._output_rings = [e.output_ring(create=True) for e in engines]
        self.rings = [r for e in engines for r in (e.descriptor_ring(create=True), e.mask_ring(create=True)) if r]
        self.rings += self._output_rings
        self.heartbeats = config.heartbeats(create=True) if config.is_head else None
        self._hung: str | None = None  # a child the watchdog found hung: killed at once on stop
        self.procs: dict[str, _Child] = {}
        self.conns: dict[str, Connection] = {}
        self.profiler = Profiler(profile_dir) if profile_dir else None
        self.spans: list = []
        self._signalled: str | None = None  # the name of the signal that stops the server
        # Written by the C-level signal handler (signal.set_wakeup_fd), so a
        # signal ends the wait on the children at once: a retried wait would
        # otherwise sleep out its timeout first.
        self._wakeup_r, self._wakeup_w = socket.socketpair()
        self._wakeup_r.setblocking(False)
        self._wakeup_w.setblocking(False)

    @property
    def output_rings(self) -> list[ShmRing]:
        """The launcher's handles on the engines' StepOutput rings, for a benchmark that plays io_proc's part."""
        return self._output_rings

    def _start_children(self, roles: tuple[str, ...]) -> None:
        """One scheduler and one process per local worker rank for each engine, then one io_proc for all (those of
        ``roles``)."""

        def add(name: str, kind: str, engine: EngineConfig, rank: int = 0) -> None:
            self.procs[name], self.conns[name] = _Child.start(kind, engine, rank)

        for e in self.config.engines():
            if "scheduler" in roles:
                add(e.scheduler_role, "scheduler", e)
            if "gpu_worker" in roles:  # tensor parallelism: one process per rank, each told its rank
                for rank in self.config.local_ranks:
                    add(e.worker_role(rank), "gpu_worker", e, rank)
        if "io_proc" in roles:
            add("io_proc", "io_proc", self.config)

    def start(self, timeout: float = 600.0) -> None:
        """Start every process and wait until all are ready (workers first when they size the KV cache).

        Raises:
            ChildFailed: a process died or reported an error first.
            TimeoutError: not ready within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        engines = self.config.engines()
        per_engine = ("scheduler" in self.roles) + ("gpu_worker" in self.roles) * len(self.config.local_ranks)
        expected = per_engine * len(engines) + ("io_proc" in self.roles)  # one io_proc for every engine
        self._attached: set[str] = set()
        self._ready: set[str] = set()
        self._kv_blocks: dict[str, int] = {}
        if not self.config.num_kv_blocks and "gpu_worker" in self.roles and len(self.roles) > 1:
            self._start_children(("gpu_worker",))
            reporters = {e.worker_role(0) for e in engines}
            self._await(deadline, expected, lambda: reporters <= self._kv_blocks.keys(), timeout)
            self.config = msgspec.structs.replace(self.config, num_kv_blocks=min(self._kv_blocks.values()))
            self._start_children(tuple(r for r in self.roles if r != "gpu_worker"))
        else:
            self._start_children(self.roles)
        self._await(deadline, expected, lambda: len(self._ready) == expected, timeout)
        if self.profiler:
            self.profiler.start({name: p.pid for name, p in self.procs.items()})

    def _await(self, deadline: float, expected: int, done, timeout: float) -> None:
        """Handle the children's start-up messages until ``done()``; unlink the rings once ``expected`` attached."""
        while not done():
            if self._signalled:
                raise ChildFailed(f"{self._signalled} during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"processes not ready after {timeout:.0f} s: {sorted(set(self.procs) - self._ready)}"
                )
            for kind, name, *rest in self._messages(0.5):
                if kind == "attached":
                    self._attached.add(name)
                    if len(self._attached) == expected:
                        for ring in self.rings:
                            ring.unlink()  # every process has mapped them: nothing can leak now
                        if self.heartbeats is not None:
                            self.heartbeats.unlink()
                elif kind == "ready":
                    self._ready.add(name)
                elif kind == "kv_blocks":
                    self._kv_blocks[name] = rest[0]
                elif kind == "error":
                    raise ChildFailed(f"{name}: {rest[0]}")
            # After the messages: a child that reported an error and exited is named by its message.
            self._check_alive()

    def _messages(self, timeout: float) -> list[tuple]:
        """Status messages that arrive within ``timeout`` seconds (none once a child has died)."""
        out = []
        conns = [c for c in self.conns.values() if not c.closed]
        for ready in wait(conns + [p.sentinel for p in self.procs.values()] + [self._wakeup_r], timeout=timeout):
            if ready is self._wakeup_r:
                with contextlib.suppress(BlockingIOError):
                    self._wakeup_r.recv(4096)
                continue
            if not isinstance(ready, Connection):
                continue  # a child exited: _check_alive says which
            try:
                out.append(ready.recv())
            except (EOFError, OSError):
                ready.close()  # the child is gone
        return out

    def check(self, timeout: float = 0.0) -> None:
        """Watch the started children for up to ``timeout`` seconds.

        Raises:
            ChildFailed: a child reported an error, exited or is hung.
            HeadStopped: this node's head stopped (a rank on another node).
        """
        # A child reports an error before it exits: its message says why, its exit status does not.
        for kind, name, *rest in self._messages(timeout):
            if kind == "error":
                raise ChildFailed(f"{name}: {rest[0]}")
            if kind == "done":
                raise HeadStopped(f"{name}: {rest[0]}")
        self._check_alive()
        self._check_heartbeats()

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                kind, why = self._last_report(name)
                if kind == "done" and p.returncode == 0:
                    raise HeadStopped(f"{name}: {why}")
                raise ChildFailed(f"{name} {_exit_description(p.returncode)}" + (f": {why}" if why else ""))

    def _check_heartbeats(self) -> None:
        """Watchdog: a child with a heartbeat older than ``--step-timeout`` is hung (docs/design.md, "Liveness")."""
        timeout = self.config.observability.step_timeout_s
        if self.heartbeats is None or not timeout:
            return
        # A grace past the timeout at which /health turns 503: a load balancer's probe sees the 503
        # before the server goes away.
        stale = self.heartbeats.stale(
            timeout + _WATCHDOG_GRACE_S, [name for name in self.procs if name in self.heartbeats.roles]
        )
        if stale:
            name, age = max(stale, key=lambda s: s[1])
            self._hung = name
            raise ChildFailed(f"{name} is hung: it has shown no progress for {age:.1f} s (--step-timeout {timeout:g})")

    def _last_report(self, name: str) -> tuple[str, str]:
        """What a dead child said last: ``("error", why)``, ``("done", why)`` (a rank on another node whose head
        stopped), or ``("", "")``."""
        last, conn = ("", ""), self.conns[name]
        try:
            while not conn.closed and conn.poll():
                kind, _, *rest = conn.recv()
                if kind in ("error", "done"):
                    last = (kind, rest[0])
        except (EOFError, OSError):
            pass
        return last

    def _on_signal(self, signum: int, _frame) -> None:
        self._signalled = signal.Signals(signum).name

    def serve(self) -> int:
        """``pipeline-serve``'s body: start, watch until a signal or a death; returns the exit code."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.set_wakeup_fd(self._wakeup_w.fileno(), warn_on_full_buffer=False)
        t0 = time.monotonic()
        ready_printed = False
        try:
            self.start()
            c, p = self.config, self.config.parallel
            if c.is_head:
                print(
                    f"pipeline-serve: serving {c.served_model_name!r} on http://{c.http.host}:{c.http.port} "
                    f"(async scheduling {'on' if c.scheduler.async_scheduling else 'off'}, "
                    f"{'simulated device' if c.is_simulated else c.device + ', ' + c.dtype}; "
                    f"ready in {time.monotonic() - t0:.1f} s)",
                    flush=True,
                )
            else:
                print(
                    f"pipeline-serve: node {p.node_rank} of {p.nnodes} running tensor-parallel ranks "
                    f"{c.local_ranks.start}-{c.local_ranks.stop - 1} of {p.tensor_parallel_size} for the head at "
                    f"{p.master_addr}:{p.master_port} (ready in {time.monotonic() - t0:.1f} s)",
                    flush=True,
                )
            ready_printed = True
            while not self._signalled:
                self.check(0.5)
            return 0
        except HeadStopped as e:
            print(f"pipeline-serve: {e}; stopping this node", file=sys.stderr)
            return 0
        except ChildFailed as e:
            if self._signalled:
                if not ready_printed:
                    print(
                        f"pipeline-serve: {self._signalled} during start-up; stopping before serving", file=sys.stderr
                    )
                return 0
            print(f"pipeline-serve: {e}; stopping the server", file=sys.stderr)
            return 1
        finally:
            signal.set_wakeup_fd(-1)
            self.stop()

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL after a grace period), then write traces and remove rings and
        sockets."""
        hung = {self._hung} if self._hung else set()
        if self.heartbeats is not None and self.config.observability.step_timeout_s:
            hung.update(
                name for name, _ in self.heartbeats.stale(self.config.observability.step_timeout_s, list(self.procs))
            )
        for name in hung:  # a stopped or stuck process would only use up the grace period
            if self.procs[name].poll() is None:
                self.procs[name].kill()
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.close()
        for conn in self.conns.values():
            conn.close()
        for ring in self.rings:
            ring.unlink()
            ring.close()
        if self.heartbeats is not None:
            self.heartbeats.unlink()
            self.heartbeats.close()
        if self.profiler:
            self.profiler.finish()
        if self.config.trace:
            # io_proc's file too when a benchmark played its part in-process.
            self.spans = load_spans([self.config.trace_path(r) for r in dict.fromkeys([*ROLES, *self.procs])])
            if self.trace_file:
                write_chrome_trace(self.spans, self.trace_file)
                print(
                    f"pipeline: wrote step timeline to {self.trace_file} (open it in https://ui.perfetto.dev)",
                    file=sys.stderr,
                )
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)
        self._wakeup_r.close()
        self._wakeup_w.close()


class _StartUpInterrupted(Exception):
    """SIGINT or SIGTERM arrived before ``Launcher.serve`` took over the signals."""


def _interrupt_start_up(signum: int, _frame) -> None:
    raise _StartUpInterrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> None:
    """Console entry of ``pipeline-serve``; exits with ``Launcher.serve``'s status (0 for a signal during start-up)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt_start_up)
    try:
        args = build_parser().parse_args(argv)
        config = make_config(args)
        obs = config.observability
        launcher = Launcher(config, trace_file=obs.trace_file or None, profile_dir=obs.profile or None)
        code = launcher.serve()  # which takes the signals over at once
    except _StartUpInterrupted as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        remove_files_of(os.getpid())
        print(f"pipeline-serve: {e} during start-up; stopped before serving, nothing left behind", file=sys.stderr)
        exit_now(0)
    if code == 0:
        print("pipeline-serve: stopped", file=sys.stderr)
    # Everything is stopped and removed: skip the interpreter's teardown (torch, when
    # --device auto imported it, costs about a second of it).
    exit_now(code)


if __name__ == "__main__":
    main()
