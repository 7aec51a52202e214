"""Server configuration shared by the launcher and the three processes."""

from __future__ import annotations

import msgspec

from pipeline.common.block_hash import root_hash
from pipeline.common.constants import cdiv
from pipeline.common.heartbeat import Heartbeats
from pipeline.common.kv_events import KVEventsConfig
from pipeline.common.layouts import Layout
from pipeline.common.shm_ring import ShmRing
from pipeline.common.step_output import OUTPUT_RING_ENTRIES, StepOutput
from pipeline.common.step_protocol import DESCRIPTOR_RING_ENTRIES, StepDescriptor, TokenMasks

# Speculative decoding methods (vLLM's names for --speculative-config's "method").
SPECULATIVE_METHODS = ("ngram", "draft_model")


class SpeculativeConfig(msgspec.Struct, frozen=True):
    """Speculative decoding (docs/design.md, "Speculative decoding"), vLLM's ``--speculative-config`` fields.

    Attributes:
        method: ``"ngram"`` (prompt lookup) or ``"draft_model"`` (a smaller model's drafts).
        num_speculative_tokens: drafts a row verifies at most per step (K).
        prompt_lookup_min, prompt_lookup_max: n-gram lengths prompt lookup tries.
        model: with ``draft_model``, the draft model's Hugging Face directory (same vocabulary as the target's).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str = ""


class LoraModule(msgspec.Struct, frozen=True):
    """An adapter served from the start: the name clients put in ``model``, and its PEFT directory."""

    name: str
    path: str


class LoraConfig(msgspec.Struct, frozen=True):
    """Multi-LoRA serving (docs/design.md, "Multi-LoRA"), vLLM's flags.

    Attributes:
        modules: ``--lora-modules``; module ``i`` has adapter id ``i + 1`` (0 is the base model).
        max_loras: distinct adapters in one step at most (the worker's adapter slots).
        max_lora_rank: the largest rank; every slot holds this rank.
        max_cpu_loras: adapters the worker keeps in host memory, least recently used out.
        allow_runtime_updating: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are served.
    """

    modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    allow_runtime_updating: bool = False


class QuantizationConfig(msgspec.Struct, frozen=True):
    """How the linear weights are held (``--quantization``, resolved by the launcher).

    Attributes:
        method: ``"none"`` (the model dtype), ``"int8"`` / ``"int4"`` (round-to-nearest at load time),
            or ``"gguf"`` (as ``gguf_file`` holds them).
        group_size: int8/int4: input columns per scale; 0: per-channel for int8, 128 for int4.
        gguf_file: the GGUF file, for ``"gguf"``.
    """

    method: str = "none"
    group_size: int = 0
    gguf_file: str = ""


class EngineConfig(msgspec.Struct, frozen=True):
    """Everything the processes need to agree on.

    Attributes:
        model: model directory in Hugging Face layout (GGUF already converted),
            or ``"sim"`` for the simulated device.
        tokenizer: directory of the tokenizer io_proc loads (the model's own,
            or the default model's for the simulated device).
        served_model_name: the name clients put in ``model``.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (``--dtype auto`` resolved).
        quantization: how the linear weights are held (``--quantization auto`` resolved).
        device: ``"cpu"`` or ``"cuda"``.
        host, port: where the HTTP server listens.
        max_num_seqs: requests in one step at most (also the number of req_index rows).
        max_num_batched_tokens: tokens in one step at most (chunked prefill budget).
        block_size: tokens per KV cache block.
        max_model_len: prompt + output tokens of one request at most (at most
            the model's ``max_position_embeddings``).
        vocab_size: token ids the model (or, simulated, its tokenizer's model) has embedding rows for;
            0 when unknown (no structured output). io_proc refuses prompt ids at or above it.
        num_kv_blocks: KV cache blocks the worker allocates; 0 until each
            engine's rank 0 has sized the cache on its device (CUDA without
            ``--kv-cache-memory``: docs/design.md, "KV cache size"), then the
            launcher starts the scheduler with the figure.
        kv_cache_memory_bytes: with ``num_kv_blocks`` 0, the KV cache's bytes
            per device; 0: what ``gpu_memory_utilization`` leaves.
        gpu_memory_utilization: the fraction of each CUDA device's memory the
            server may use when the worker sizes the KV cache.
        async_scheduling: plan step N+1 while step N runs.
        enable_prefix_caching: reuse the KV blocks of computed prefixes
            (docs/design.md, "Prefix caching").
        debug_token_cache_poison: poison consumed token-id cache entries and
            check every placeholder read (slower; tests turn it on).
        attention_backend: the worker's attention backend, one of
            ``gpu_worker.attention.ATTENTION_BACKENDS`` or ``auto``, which
            is flashinfer where it can run, else cpu_paged on CPU where its kernel
            builds, else torch_bucketed.
        sim_step_us, sim_token_us: with ``model == "sim"``, the simulated
            device's step time ``A + B × tokens`` in microseconds.
        trace: record per-step spans for a Chrome-trace timeline; each
            process writes its spans to ``trace_path(role)`` when it exits.
        step_shapes_file: where the worker writes, on exit, every step's
            rows (tokens scheduled, start position, sampled or not) as an
            ``.npz`` file; empty: not recorded. ``pipeline-bench --bound``
            replays them through the bare model.
        max_request_body_bytes: largest HTTP request body io_proc reads;
            a larger one is answered 413 before it is parsed.
        http_header_timeout_s: seconds a client has to send a request's
            headers, from the connection's opening (or the first byte of the
            next request on a kept-alive connection); then it is closed.
        http_body_timeout_s: seconds a client has to send a request's body
            once its headers are in; then it gets 408 and is closed.
        limit_concurrency: open HTTP connections plus running requests at
            which io_proc answers new requests with 503.
        max_seqs_per_request: sequences one request may ask for (prompts
            times ``n``); io_proc refuses more with a 400.
        max_grammar_memory_per_request_mb: MiB of matcher memory one request
            with a grammar may take (its compiled grammar and a copy per
            choice); the scheduler refuses more with a 400.
        max_grammar_memory_mb: MiB of matcher memory every request (and the
            cache of compiled grammars) may take together; a request that
            would pass it waits.
        worker_threads: torch intra-op threads of the worker; 0: one per CPU the worker may use,
            less those other programs keep busy (``ThreadGovernor``).
        worker_cpus: CPUs the worker runs on; empty: every CPU.
        frontend_cpus: CPUs the scheduler and io_proc run on; empty: every CPU.
        tensor_parallel_size: worker ranks the model is sharded over, one
            process and one device each (docs/design.md, "Parallelism").
        data_parallel_size: engines (scheduler plus worker ranks) behind the
            one io_proc.
        cuda_graph_sizes: batch sizes of decode-only steps the worker
            captures as CUDA graphs, ascending; empty: every step runs eagerly
            (``--enforce-eager``, CPU, tensor parallelism). docs/design.md, "CUDA graphs for decode".
        nnodes: machines the tensor-parallel ranks are spread over; each runs
            ``tensor_parallel_size / nnodes`` of them (docs/design.md,
            "Parallelism").
        node_rank: this machine's place, 0 .. ``nnodes - 1``; node 0 (the
            head) runs the HTTP server, the scheduler and ranks 0 ..
            ``ranks_per_node - 1``, node n ranks ``n * ranks_per_node`` onward.
        master_addr, master_port: the head's address and a free TCP port on
            it, where the ranks meet (``tcp://`` rendezvous) when ``nnodes > 1``.
        engine_index: which engine this config addresses, 0 ..
            ``data_parallel_size - 1`` (see ``engines``); it names the
            engine's rings, control socket, rendezvous and processes.
        api_key: when not empty, io_proc requires ``Authorization: Bearer
            <api_key>`` on every route but ``/health`` and ``/metrics``.
        step_timeout_s: seconds a step in flight may go without its output,
            or a process without a heartbeat, before the server declares it
            hung and stops with a message naming it; 0 disables the watchdog.
        speculative: speculative decoding's settings; None: off.
        lora: LoRA adapters' settings; None: ``--enable-lora`` off.
        speculative_policy: ``"adaptive"`` (each step drafts where measured acceptance and cost say it
            pays) or ``"always"`` (every row that may draft drafts K).
        grammar_jump_forward: with prompt lookup, a constrained row whose grammar forces its next tokens
            verifies those as its drafts (docs/design.md, "Jump-forward").
        sim_draft_acceptance: with ``model == "sim"`` and speculative decoding,
            the probability that each simulated draft is right.
        log_stats_interval_s: seconds between two stats lines in io_proc's
            log while there is traffic; 0: none.
        uvicorn_access_log: io_proc logs an access line per HTTP request (uvicorn's).
        enable_log_requests: io_proc logs a line per finished request (id, prompt
            tokens, sampling parameters, finish reason, tokens, TTFT, e2e).
        log_prompts: those lines include the prompt (otherwise never logged).
        metrics_compat: ``"vllm"``: ``/metrics`` also exports vLLM's metric
            names and labels (docs/design.md, "Metrics"); ``"none"``: only the
            ``pipeline_`` family.
        kv_events: publish the prefix cache's KV-cache events (``--kv-events-config``); None: off.
        debug_fail_step: the worker raises ``RuntimeError`` when it
            launches this step, as a failing forward pass would (the fault
            tests use it); -1: never.
        chat_template: a Jinja chat template that replaces the tokenizer's
            (``--chat-template``, read at start-up); empty: the tokenizer's own.
        tool_call_parser: the tool-call format of ``tool_choice: auto`` and,
            with a template that renders tools, of ``required``
            (docs/design.md, "Tool calling"); empty: none.
        enable_auto_tool_choice: serve ``tool_choice: auto`` (needs a parser).
        responses_store_max_entries, responses_store_max_bytes,
        responses_store_max_age_s: the bounds of ``/v1/responses``' store of
            responses kept for ``previous_response_id`` (``store: true``); the
            oldest go first. 0 entries: nothing is stored.
        instance: unique id of this server instance (names of rings and sockets).
        ipc_dir: private directory holding this instance's zmq sockets.
    """

    model: str
    served_model_name: str
    dtype: str = "float32"
    quantization: QuantizationConfig = QuantizationConfig()
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    block_size: int = 16
    max_model_len: int = 2048
    num_kv_blocks: int = 1024
    kv_cache_memory_bytes: int = 0
    gpu_memory_utilization: float = 0.9
    vocab_size: int = 0
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    debug_token_cache_poison: bool = False
    sim_step_us: float = 10_000.0
    sim_token_us: float = 0.0
    tokenizer: str = ""
    attention_backend: str = "auto"
    trace: bool = False
    step_shapes_file: str = ""
    max_request_body_bytes: int = 4 * 2**20
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 60.0
    limit_concurrency: int = 4096
    max_seqs_per_request: int = 2048
    max_grammar_memory_per_request_mb: int = 256
    max_grammar_memory_mb: int = 2048
    worker_threads: int = 0
    worker_cpus: tuple[int, ...] = ()
    frontend_cpus: tuple[int, ...] = ()
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    cuda_graph_sizes: tuple[int, ...] = ()
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 29500
    engine_index: int = 0
    api_key: str = ""
    step_timeout_s: float = 300.0
    speculative: SpeculativeConfig | None = None
    speculative_policy: str = "adaptive"
    lora: LoraConfig | None = None
    grammar_jump_forward: bool = True
    sim_draft_acceptance: float = 0.7
    metrics_compat: str = "none"
    kv_events: KVEventsConfig | None = None
    log_stats_interval_s: float = 10.0
    uvicorn_access_log: bool = True
    enable_log_requests: bool = False
    log_prompts: bool = False
    debug_fail_step: int = -1
    chat_template: str = ""
    tool_call_parser: str = ""
    enable_auto_tool_choice: bool = False
    responses_store_max_entries: int = 1024
    responses_store_max_bytes: int = 64 * 2**20
    responses_store_max_age_s: float = 3600.0
    instance: str = ""
    ipc_dir: str = ""

    @property
    def is_simulated(self) -> bool:
        """True when the simulated device replaces the model."""
        return self.model == "sim"

    @property
    def block_hash_root(self) -> bytes:
        """The parent name of every prompt's first KV block, from what else makes its content: model, dtype."""
        return root_hash(self.model, self.dtype)

    def engines(self) -> list[EngineConfig]:
        """One config per data-parallel engine, ``engine_index`` 0 .. ``data_parallel_size - 1``."""
        return [msgspec.structs.replace(self, engine_index=e) for e in range(self.data_parallel_size)]

    @property
    def _engine_suffix(self) -> str:
        # Engine 0 keeps the single-engine names.
        return f"-dp{self.engine_index}" if self.engine_index else ""

    @property
    def scheduler_role(self) -> str:
        """Process name of this engine's scheduler: ``scheduler``, ``scheduler-dp<e>`` for engine e > 0."""
        return "scheduler" + self._engine_suffix

    def worker_role(self, rank: int) -> str:
        """Process name of this engine's worker rank ``rank``: ``gpu_worker[-dp<e>][-tp<rank>]``.

        The engine part is left out for engine 0 and the rank part for rank 0.
        """
        return "gpu_worker" + self._engine_suffix + (f"-tp{rank}" if rank else "")

    @property
    def is_head(self) -> bool:
        """True on node 0, which runs io_proc, the scheduler and the rings (always, on one node)."""
        return self.node_rank == 0

    @property
    def ranks_per_node(self) -> int:
        """Worker ranks each node runs: ``tensor_parallel_size / nnodes``."""
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The tensor-parallel ranks this node runs (all of them on one node)."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    def device_index(self, rank: int) -> int:
        """CUDA device of this engine's worker rank ``rank`` on its node: engines take consecutive groups."""
        return self.engine_index * self.ranks_per_node + rank % self.ranks_per_node

    @property
    def tp_init_method(self) -> str:
        """torch.distributed rendezvous of the engine's worker ranks.

        On one node a file store in the private ``ipc_dir`` (no port to race
        for); over several nodes the head's TCP store at ``master_addr:master_port``.
        """
        if self.nnodes > 1:
            return f"tcp://{self.master_addr}:{self.master_port}"
        return f"file://{self.ipc_dir}/tp-rendezvous{self._engine_suffix}"

    def trace_path(self, role: str) -> str:
        """Where process ``role`` writes its trace spans (JSON list)."""
        return f"{self.ipc_dir}/trace-{role}.json"

    @property
    def num_speculative_tokens(self) -> int:
        """K: drafts a row verifies at most per step; 0 without speculative decoding."""
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block-table row."""
        return cdiv(self.max_model_len, self.block_size)

    @property
    def descriptor_layout(self) -> Layout:
        return StepDescriptor.layout(
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.block_size,
            self.max_blocks_per_seq,
        )

    @property
    def output_layout(self) -> Layout:
        k = self.num_speculative_tokens
        return StepOutput.layout(self.max_num_seqs * (1 + k), self.max_num_batched_tokens, k)

    @property
    def descriptor_ring_name(self) -> str:
        return f"/pipeline-{self.instance}{self._engine_suffix}-desc"

    @property
    def mask_ring_name(self) -> str:
        return f"/pipeline-{self.instance}{self._engine_suffix}-mask"

    @property
    def output_ring_name(self) -> str:
        return f"/pipeline-{self.instance}{self._engine_suffix}-out"

    def descriptor_ring(self, create: bool = False) -> ShmRing[StepDescriptor]:
        """The StepDescriptor ring (scheduler writes; every head-node worker rank reads, as reader ``rank``).

        Ranks on other nodes get the descriptors relayed by rank 0 instead
        (docs/design.md, "Parallelism"). ``create`` in the launcher only.
        """
        return ShmRing(
            self.descriptor_ring_name,
            self.descriptor_layout,
            DESCRIPTOR_RING_ENTRIES,
            self.ranks_per_node,
            create,
            StepDescriptor,
        )

    def mask_ring(self, create: bool = False) -> ShmRing[TokenMasks] | None:
        """The TokenMasks ring (scheduler writes the masks of a step's constrained rows; readers as the
        descriptor ring's); None without a vocabulary (no structured output)."""
        if not self.vocab_size:
            return None
        # A row that verifies drafts has a mask per sampled position.
        layout = TokenMasks.layout(self.max_num_seqs * (1 + self.num_speculative_tokens), self.vocab_size)
        return ShmRing(self.mask_ring_name, layout, DESCRIPTOR_RING_ENTRIES, self.ranks_per_node, create, TokenMasks)

    def output_ring(self, create: bool = False) -> ShmRing[StepOutput]:
        """The StepOutput ring (worker rank 0 writes; scheduler and io_proc read)."""
        return ShmRing(self.output_ring_name, self.output_layout, OUTPUT_RING_ENTRIES, 2, create, StepOutput)

    @property
    def heartbeat_roles(self) -> list[str]:
        """The processes of the head node that beat (docs/design.md, "Liveness"): io_proc, then each
        engine's scheduler and head-node worker ranks."""
        roles = ["io_proc"]
        for e in self.engines():
            roles += [e.scheduler_role, *(e.worker_role(r) for r in range(self.ranks_per_node))]
        return roles

    def heartbeats(self, create: bool = False) -> Heartbeats:
        """The instance's heartbeat table (head node only); ``create`` in the launcher only."""
        return Heartbeats(f"/pipeline-{self.instance}-beat", self.heartbeat_roles, create)

    @property
    def control_address(self) -> str:
        """zmq address of io_proc -> this engine's scheduler control messages."""
        return f"ipc://{self.ipc_dir}/to_scheduler{self._engine_suffix}"

    @property
    def reply_address(self) -> str:
        """zmq address of scheduler -> io_proc replies (every engine's scheduler connects to it)."""
        return f"ipc://{self.ipc_dir}/to_io"
