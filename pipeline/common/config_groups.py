"""``pipeline-serve``'s flags, one field each in the group of what they configure.

A field's ``flag(...)`` metadata gives its help, choices and check (``common/flags.py``); the parser is
generated from ``model_flags.RESOLVED`` (what ``server_config.make_config`` resolves) and ``GROUPS``, one
``--help`` section each; every group of ``GROUPS`` travels in the ``EngineConfig`` as parsed (but for
``WorkerConfig.attention_backend`` and ``cuda_graph_sizes``). To add a flag, add a field to its group and read it
where it is used.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from pipeline.common.flags import at_least_0, flag, off_or_positive, parse_cpu_list, positive


class HttpConfig(msgspec.Struct, frozen=True):
    """The HTTP server and its limits."""

    host: Annotated[str, flag("Address the HTTP server binds.")] = "127.0.0.1"
    port: Annotated[int, flag("Port the HTTP server listens on.", check=positive)] = 8000
    api_key: Annotated[
        str,
        flag(
            "Require `Authorization: Bearer <key>` on the API routes (401 without it); /health and /metrics stay open."
        ),
    ] = ""
    max_request_body_bytes: Annotated[
        int,
        flag("Largest HTTP request body accepted; a larger one gets 413 before it is parsed.", check=positive),
    ] = 4 * 2**20
    header_timeout_s: Annotated[
        float,
        flag(
            "Seconds a client has to send a request's headers; then the connection is closed.",
            name="--http-header-timeout",
            check=positive,
        ),
    ] = 10.0
    body_timeout_s: Annotated[
        float,
        flag(
            "Seconds a client has to send a request's body once its headers are in; then 408.",
            name="--http-body-timeout",
            check=positive,
        ),
    ] = 60.0
    keep_alive_timeout_s: Annotated[
        float,
        flag(
            "Seconds an idle kept-alive connection stays open. Above the 5 s after which httpx (the openai SDK) "
            "drops an idle connection, so that a client never sends on one the server is closing.",
            name="--timeout-keep-alive",
            check=positive,
        ),
    ] = 20.0
    limit_concurrency: Annotated[
        int,
        flag("Open HTTP connections plus running requests at which new requests get 503.", check=positive),
    ] = 4096
    max_seqs_per_request: Annotated[
        int,
        flag(
            "Sequences one request may ask for at most: the prompts of a completions request times n "
            "(n for a chat request). A request past it gets a 400 naming n or prompt.",
            check=positive,
        ),
    ] = 2048
    responses_store_max_entries: Annotated[
        int,
        flag(
            "/v1/responses: responses kept in memory for previous_response_id (requests with "
            "store: true); beyond it the oldest are dropped. 0: nothing is stored.",
            check=at_least_0,
        ),
    ] = 1024
    responses_store_max_bytes: Annotated[
        int,
        flag(
            "/v1/responses: bytes the stored responses may keep alive in all (their JSON size; a "
            "follow-up shares its history); beyond it the oldest are dropped, and one that cannot fit "
            "alone is not kept (it says store: false).",
            check=at_least_0,
        ),
    ] = 64 * 2**20
    responses_store_max_age_s: Annotated[
        float,
        flag("/v1/responses: seconds a stored response is kept.", name="--responses-store-max-age", check=at_least_0),
    ] = 3600.0


class ToolConfig(msgspec.Struct, frozen=True):
    """Tool calling (docs/design.md, "Tool calling")."""

    tool_call_parser: Annotated[
        str,
        flag(
            "The format the model writes tool calls in (vLLM's names): hermes (Hermes, Qwen 2.5 / 3: "
            "<tool_call>{...}</tool_call>), llama3_json (Llama 3.1 / 3.2 JSON), mistral ([TOOL_CALLS][...]), "
            "pythonic ([f(x=1)]). Calls are parsed out of the output, and a grammar built from the tools' "
            "schemas keeps their arguments valid. With a template that renders tools, tool_choice "
            "required or a named function uses this format too; otherwise a JSON list of calls.",
            registry="pipeline.io_proc.tool_parsers:TOOL_PARSERS",
        ),
    ] = ""
    enable_auto_tool_choice: Annotated[
        bool,
        flag(
            'Serve tool_choice "auto" (the default when a request has tools): the model may call '
            "tools or answer; needs --tool-call-parser and a chat template that renders tools."
        ),
    ] = False


class SchedulerConfig(msgspec.Struct, frozen=True):
    """What a step holds and how the scheduler plans it."""

    max_num_seqs: Annotated[int, flag("Requests in one step at most.", check=positive)] = 256
    max_num_batched_tokens: Annotated[
        int,
        flag(
            "Tokens in one step at most; longer prompts are prefilled in chunks of this size, mixed with decodes.",
            check=positive,
        ),
    ] = 512
    block_size: Annotated[int, flag("Tokens per KV cache block.", check=positive)] = 16
    async_scheduling: Annotated[
        bool,
        flag(
            "Plan step N+1 while step N runs. --no-async-scheduling plans in lock step "
            "(the reference for A/B measurements and correctness)."
        ),
    ] = True
    enable_prefix_caching: Annotated[
        bool,
        flag(
            "Keep the KV blocks of computed prefixes (finished requests' too, evicted least recently "
            "used first) and prefill only what a new request does not share with them; with -dp, route a "
            "request to the engine holding its longest prefix. --no-enable-prefix-caching recomputes every "
            "prompt."
        ),
    ] = True
    speculative_policy: Annotated[
        str,
        flag(
            "With --speculative-config: adaptive (default) verifies drafts only where the measured "
            "acceptance and step time say they pay; always gives K drafts to every decoding request whose "
            "last lookup matched (before max_tokens, past min_tokens, without a tool-call trigger), whatever "
            "they cost.",
            choices=("adaptive", "always"),
        ),
    ] = "adaptive"
    grammar_jump_forward: Annotated[
        bool,
        flag(
            "With --speculative-config (prompt lookup): a request with a grammar (response_format, guided_*, "
            "a tool call) verifies the tokens its grammar forces next (a JSON key, '\": ', a closing brace) as "
            "its drafts, several tokens a forward pass; the output is unchanged. --no-grammar-jump-forward: "
            "prompt lookup's drafts only."
        ),
    ] = True
    max_grammar_memory_per_request_mb: Annotated[
        int,
        flag(
            "Matcher memory one structured-output request may take: its compiled grammar plus a "
            "copy per choice, as measured when the scheduler compiles it. A request over it gets a 400 "
            "naming its grammar field.",
            name="--max-grammar-memory-per-request",
            metavar="MiB",
            check=positive,
        ),
    ] = 256
    max_grammar_memory_mb: Annotated[
        int,
        flag(
            "Matcher memory all structured-output requests, and the cache of compiled grammars, may "
            "take together. A request that would pass it waits (compiled grammars nobody uses are dropped "
            "first) until others end; it is never refused for it. At least --max-grammar-memory-per-request.",
            name="--max-grammar-memory",
            metavar="MiB",
            check=positive,
        ),
    ] = 2048


class WorkerConfig(msgspec.Struct, frozen=True):
    """The model worker: attention, CUDA graphs, memory, threads and the simulated device."""

    attention_backend: Annotated[
        str,
        flag(
            "How the worker computes attention. auto: flashinfer where it can run, else cpu_paged where "
            "its kernel builds, else torch_bucketed.",
            choices=("auto",),
            registry="pipeline.gpu_worker.attention:ATTENTION_BACKENDS",
        ),
    ] = "auto"
    cuda_graph_sizes: Annotated[
        tuple[int, ...] | None,
        flag(
            "Batch sizes of decode-only steps captured as CUDA graphs at start-up (CUDA, one rank "
            "only). A decode step of B requests replays the graph of the smallest size >= B with the "
            "extra rows padded out; steps with prefill tokens or more requests run eagerly. Sizes "
            "above --max-num-seqs or --max-num-batched-tokens are dropped. Default, as vLLM's: 1 2 4, "
            "multiples of 8 up to 256, then of 16, up to --max-num-seqs capped at 512. Ignored on CPU.",
            nargs="+",
            metavar="N",
        ),
    ] = None
    enforce_eager: Annotated[bool, flag("Run every step eagerly: capture no CUDA graphs.")] = False
    gpu_memory_utilization: Annotated[
        float,
        flag(
            "On CUDA without --kv-cache-memory or --num-kv-blocks: the fraction of each device's memory "
            "the server may use. After loading the weights, each worker runs one profiling step of "
            "--max-num-batched-tokens tokens, and the KV cache gets this fraction of the device's memory minus "
            "what is in use then (weights, other processes) and the step's peak activations (as vLLM).",
            check=lambda v: None if 0 < v <= 1 else f"must be in (0, 1], got {v}",
        ),
    ] = 0.9
    debug_token_cache_poison: Annotated[
        bool,
        flag(
            "Poison token-id cache entries once consumed and check every placeholder read "
            "(slower; catches a placeholder resolving to a stale token)."
        ),
    ] = False
    sim_draft_acceptance: Annotated[
        float,
        flag(
            "With --model sim and --speculative-config: the probability that each simulated draft is right.",
            check=lambda v: None if 0 <= v <= 1 else "must be a probability from 0 to 1",
        ),
    ] = 0.7
    sim_step_us: Annotated[float, flag("With --model sim: fixed time of one simulated step, microseconds.")] = 10_000.0
    sim_token_us: Annotated[
        float, flag("With --model sim: extra simulated time per token in the step, microseconds.")
    ] = 0.0
    worker_threads: Annotated[
        int,
        flag(
            "torch intra-op threads of the model worker; 0: one per CPU the worker may use (its affinity, see "
            "--worker-cpus, and a cgroup CPU quota), less one per CPU other programs keep busy, checked every "
            "0.25 s.",
            check=lambda v: None if v >= 0 else "must be 0 (automatic) or positive",
        ),
    ] = 0


class ParallelConfig(msgspec.Struct, frozen=True):
    """Engines, ranks, nodes and the CPUs the processes run on (docs/design.md, "Parallelism")."""

    tensor_parallel_size: Annotated[
        int,
        flag(
            "Shard the model over this many worker processes, one device each (Megatron-style: "
            "attention heads, KV heads and the MLP split across ranks, two all-reduces per layer, "
            "vocabulary-parallel embedding and LM head). Collectives use torch.distributed: NCCL "
            "on CUDA (rank r on cuda:r), gloo on CPU. Must divide the attention heads and the "
            "intermediate size, and divide or be a multiple of the KV heads (then each KV head is "
            "replicated). Each rank reads only its shard from the safetensors checkpoint.",
            short="-tp",
            check=positive,
        ),
    ] = 1
    data_parallel_size: Annotated[
        int,
        flag(
            "Run this many independent engines (each a scheduler and its --tensor-parallel-size "
            "worker ranks, with its own KV cache) behind the one HTTP server, which sends each new "
            "request to the engine with the fewest waiting, then running, requests. On CUDA engine "
            "e uses devices e*TP .. e*TP+TP-1.",
            short="-dp",
            check=positive,
        ),
    ] = 1
    nnodes: Annotated[
        int,
        flag(
            "Spread the --tensor-parallel-size ranks over this many machines, the same number on each "
            "(it must divide the size). Start pipeline-serve on every machine with the same flags and "
            "its own --node-rank; the ranks meet at --master-addr:--master-port (torchrun style). "
            "Node 0 runs the HTTP server, the scheduler and ranks 0 .. TP/nnodes-1; its rank 0 "
            "relays every step's descriptor to the other nodes' ranks with a torch.distributed "
            "broadcast over gloo. Not combinable with --data-parallel-size.",
            check=positive,
        ),
    ] = 1
    node_rank: Annotated[
        int,
        flag(
            "This machine's place among the --nnodes, 0 .. nnodes-1. Node 0 is the head (the whole "
            "server); node n runs only tensor-parallel ranks n*TP/nnodes .. (n+1)*TP/nnodes-1 and "
            "no HTTP server (its --host and --port are unused)."
        ),
    ] = 0
    master_addr: Annotated[
        str,
        flag(
            "With --nnodes > 1 (then required): the head node's address, which every node must "
            "reach; the ranks' TCP rendezvous store listens there."
        ),
    ] = ""
    master_port: Annotated[
        int,
        flag(
            "With --nnodes > 1: a free TCP port on the head node for the ranks' rendezvous store "
            "(torch.distributed also opens further ports between the ranks).",
            check=lambda v: None if 0 < v < 65536 else f"{v} is not a TCP port (1 .. 65535)",
        ),
    ] = 29500
    worker_cpus: Annotated[
        tuple[int, ...],
        flag(
            "CPUs the model worker runs on, as a list like 0-3,6 (Linux CPU numbers); empty: every "
            "CPU. With --frontend-cpus, keeps the worker's threads and the other processes off each "
            "other's cores.",
            convert=parse_cpu_list,
        ),
    ] = ()
    frontend_cpus: Annotated[
        tuple[int, ...],
        flag(
            "CPUs the scheduler and HTTP/tokenizer processes run on, as a list like 4,5; empty: every CPU.",
            convert=parse_cpu_list,
        ),
    ] = ()


class ObservabilityConfig(msgspec.Struct, frozen=True):
    """The watchdog, metrics, logs, traces and profiles."""

    step_timeout_s: Annotated[
        float,
        flag(
            "Seconds a step may run without producing its output, or a process (scheduler, worker, "
            "io_proc) go without a heartbeat, before the server declares it hung, names it and stops with "
            "an error (clients get 503); until then /health and /metrics answer 503 once the scheduler or a "
            "worker has gone that long. 0 disables the watchdog.",
            name="--step-timeout",
            check=off_or_positive,
        ),
    ] = 300.0
    metrics_compat: Annotated[
        str,
        flag(
            "vllm: /metrics also exports every vLLM metric the server has under vLLM's exact name and "
            "labels (vllm:num_requests_running{model_name,engine}, vllm:time_to_first_token_seconds, ...), "
            "so vLLM's Grafana dashboards and autoscalers read it unchanged. Off by default: the pipeline_ "
            "names alone cannot be mistaken for vLLM's.",
            choices=("none", "vllm"),
        ),
    ] = "none"
    log_stats_interval_s: Annotated[
        float,
        flag(
            "Log a stats line this often while there is traffic (vLLM's: prompt and generation "
            "throughput, running and waiting requests, KV cache usage, preemptions, and the token gap p50 "
            "and device-busy fraction over the interval); 0 turns it off.",
            name="--log-stats-interval",
            metavar="SECONDS",
            check=off_or_positive,
        ),
    ] = 10.0
    disable_uvicorn_access_log: Annotated[
        bool,
        flag("Do not log uvicorn's access line (client, request line, status) for each HTTP request."),
    ] = False
    enable_log_requests: Annotated[
        bool,
        flag(
            "Log one line per finished request: its id, prompt tokens, sampling parameters, finish "
            "reason, output tokens, time to first token and end-to-end latency. The prompt text is "
            "never logged unless --log-prompts is given too."
        ),
    ] = False
    log_prompts: Annotated[
        bool, flag("With --enable-log-requests: include each request's prompt (or chat messages) in its line.")
    ] = False
    trace_file: Annotated[
        str,
        flag(
            "Write a Chrome-trace JSON step timeline (one track per process) to FILE on exit; "
            "open it in Perfetto (ui.perfetto.dev).",
            name="--trace",
            metavar="FILE",
        ),
    ] = ""
    profile: Annotated[
        str,
        flag(
            "Record each process with py-spy; one flame graph per process (DIR/<process>.svg) "
            "is written when the server stops.",
            metavar="DIR",
        ),
    ] = ""


# The groups an EngineConfig carries, by its attribute's name (also their --help sections, after "model").
GROUPS: dict[str, type[msgspec.Struct]] = {
    "http": HttpConfig,
    "tools": ToolConfig,
    "scheduler": SchedulerConfig,
    "worker": WorkerConfig,
    "parallel": ParallelConfig,
    "observability": ObservabilityConfig,
}
