"""Server configuration shared by the launcher and the three processes."""

from __future__ import annotations

import msgspec

from pipeline.common.block_hash import root_hash
from pipeline.common.config_groups import (
    HttpConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    ToolConfig,
    WorkerConfig,
)
from pipeline.common.constants import cdiv
from pipeline.common.heartbeat import Heartbeats
from pipeline.common.kv_events import KVEventsConfig
from pipeline.common.layouts import Layout
from pipeline.common.shm_ring import ShmRing
from pipeline.common.step_output import OUTPUT_RING_ENTRIES, StepOutput
from pipeline.common.step_protocol import DESCRIPTOR_RING_ENTRIES, StepDescriptor, TokenMasks

# Speculative decoding methods (vLLM's names for --speculative-config's "method").
SPECULATIVE_METHODS = ("ngram", "draft_model")


# The flag groups a process never reads (every process reads ``scheduler`` and ``parallel``).
_UNREAD_GROUPS = {
    "io_proc": ("worker",),
    "scheduler": ("http", "tools", "worker"),
    "gpu_worker": ("http", "tools", "observability"),
}


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
            ``"gguf"`` (as ``gguf_file`` holds them), or a quantized checkpoint's own method
            (``checkpoint_quant.METHODS``: as its tensors hold them).
        group_size: int8/int4: input columns per scale; 0: per-channel for int8, 128 for int4.
        gguf_file: the GGUF file, for ``"gguf"``.
    """

    method: str = "none"
    group_size: int = 0
    gguf_file: str = ""


class EngineConfig(msgspec.Struct, frozen=True):
    """Everything the processes need to agree on: the flags' groups as parsed (``config.scheduler.max_num_seqs``;
    ``common/config_groups.py`` documents each field) and what ``server_config.make_config`` resolved.

    Attributes:
        model: model directory in Hugging Face layout (GGUF already converted),
            or ``"sim"`` for the simulated device.
        tokenizer: directory of the tokenizer io_proc loads (the model's own,
            or the default model's for the simulated device).
        served_model_name: the name clients put in ``model``.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (``--dtype auto`` resolved).
        quantization: how the linear weights are held (``--quantization auto`` resolved).
        device: ``"cpu"`` or ``"cuda"``.
        max_model_len: prompt + output tokens of one request at most (at most
            the model's ``max_position_embeddings``).
        vocab_size: token ids the model (or, simulated, its tokenizer's model) has embedding rows for;
            0 when unknown (no structured output). io_proc refuses prompt ids at or above it.
        num_kv_blocks: KV cache blocks the worker allocates; 0 until each
            engine's rank 0 has sized the cache on its device (CUDA without
            ``--kv-cache-memory``: docs/design.md, "KV cache size"), then the
            launcher starts the scheduler with the figure.
        kv_cache_memory_bytes: with ``num_kv_blocks`` 0, the KV cache's bytes
            per device; 0: what ``worker.gpu_memory_utilization`` leaves.
        speculative: speculative decoding's settings; None: off.
        lora: LoRA adapters' settings; None: ``--enable-lora`` off.
        kv_events: publish the prefix cache's KV-cache events (``--kv-events-config``); None: off.
        chat_template: a Jinja chat template that replaces the tokenizer's
            (``--chat-template``, read at start-up); empty: the tokenizer's own.
        trace: record per-step spans for a Chrome-trace timeline; each
            process writes its spans to ``trace_path(role)`` when it exits.
        step_shapes_file: where the worker writes, on exit, every step's
            rows (tokens scheduled, start position, sampled or not) as an
            ``.npz`` file; empty: not recorded. ``pipeline-bench --bound``
            replays them through the bare model.
        debug_fail_step: the worker raises ``RuntimeError`` when it
            launches this step, as a failing forward pass would (the fault
            tests use it); -1: never.
        engine_index: which engine this config addresses, 0 ..
            ``parallel.data_parallel_size - 1`` (see ``engines``); it names the
            engine's rings, control socket, rendezvous and processes.
        instance: unique id of this server instance (names of rings and sockets).
        ipc_dir: private directory holding this instance's zmq sockets.
        http, tools, scheduler, worker, parallel, observability: the flags' groups.
            ``worker.attention_backend`` is resolved (never ``auto`` with speculative decoding on
            CUDA) and ``worker.cuda_graph_sizes`` is the sizes to capture (empty: every step eager).
    """

    model: str
    served_model_name: str
    tokenizer: str = ""
    dtype: str = "float32"
    quantization: QuantizationConfig = QuantizationConfig()
    device: str = "cpu"
    max_model_len: int = 2048
    vocab_size: int = 0
    num_kv_blocks: int = 1024
    kv_cache_memory_bytes: int = 0
    speculative: SpeculativeConfig | None = None
    lora: LoraConfig | None = None
    kv_events: KVEventsConfig | None = None
    chat_template: str = ""
    trace: bool = False
    step_shapes_file: str = ""
    debug_fail_step: int = -1
    engine_index: int = 0
    instance: str = ""
    ipc_dir: str = ""
    # None only in a process that does not read the group (``for_process``).
    http: HttpConfig | None = msgspec.field(default_factory=HttpConfig)
    tools: ToolConfig | None = msgspec.field(default_factory=ToolConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    worker: WorkerConfig | None = msgspec.field(default_factory=WorkerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    observability: ObservabilityConfig | None = msgspec.field(default_factory=ObservabilityConfig)

    def for_process(self, kind: str) -> EngineConfig:
        """This config as process ``kind`` (``child.ENTRIES``) receives it: the flag groups it does not read are
        None."""
        return msgspec.structs.replace(self, **{group: None for group in _UNREAD_GROUPS[kind]})

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
        return [msgspec.structs.replace(self, engine_index=e) for e in range(self.parallel.data_parallel_size)]

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
        return self.parallel.node_rank == 0

    @property
    def ranks_per_node(self) -> int:
        """Worker ranks each node runs: ``tensor_parallel_size / nnodes``."""
        return self.parallel.tensor_parallel_size // self.parallel.nnodes

    @property
    def local_ranks(self) -> range:
        """The tensor-parallel ranks this node runs (all of them on one node)."""
        return range(self.parallel.node_rank * self.ranks_per_node, (self.parallel.node_rank + 1) * self.ranks_per_node)

    def device_index(self, rank: int) -> int:
        """CUDA device of this engine's worker rank ``rank`` on its node: engines take consecutive groups."""
        return self.engine_index * self.ranks_per_node + rank % self.ranks_per_node

    @property
    def tp_init_method(self) -> str:
        """torch.distributed rendezvous of the engine's worker ranks.

        On one node a file store in the private ``ipc_dir`` (no port to race
        for); over several nodes the head's TCP store at ``master_addr:master_port``.
        """
        if self.parallel.nnodes > 1:
            return f"tcp://{self.parallel.master_addr}:{self.parallel.master_port}"
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
        return cdiv(self.max_model_len, self.scheduler.block_size)

    @property
    def descriptor_layout(self) -> Layout:
        return StepDescriptor.layout(
            self.scheduler.max_num_seqs,
            self.scheduler.max_num_batched_tokens,
            self.scheduler.block_size,
            self.max_blocks_per_seq,
        )

    @property
    def output_layout(self) -> Layout:
        k = self.num_speculative_tokens
        return StepOutput.layout(self.scheduler.max_num_seqs * (1 + k), self.scheduler.max_num_batched_tokens, k)

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
        layout = TokenMasks.layout(self.scheduler.max_num_seqs * (1 + self.num_speculative_tokens), self.vocab_size)
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
