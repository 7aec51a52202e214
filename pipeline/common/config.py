"""Server configuration shared by the launcher and the three processes."""

from __future__ import annotations

import msgspec

from pipeline.common.constants import cdiv
from pipeline.common.layouts import Layout
from pipeline.common.shm_ring import ShmRing
from pipeline.common.step_protocol import DESCRIPTOR_RING_SLOTS, OUTPUT_RING_SLOTS, StepDescriptor, StepOutput


class EngineConfig(msgspec.Struct, frozen=True):
    """Everything the processes need to agree on.

    Attributes:
        model: model directory in Hugging Face layout (GGUF already converted),
            or ``"sim"`` for the simulated device.
        tokenizer: directory of the tokenizer io_proc loads (the model's own,
            or the default model's for the simulated device).
        served_model_name: the name clients put in ``model``.
        dtype: ``"float32"`` or ``"bfloat16"``.
        device: ``"cpu"`` or ``"cuda"``.
        host, port: where the HTTP server listens.
        max_num_seqs: requests in one step at most (also the number of slots).
        max_num_batched_tokens: tokens in one step at most (chunked prefill budget).
        block_size: tokens per KV cache block.
        max_model_len: prompt + output tokens of one request at most (at most
            the model's ``max_position_embeddings``).
        vocab_size: token ids the model has embedding rows for; 0 when there
            is no model (the simulated device). io_proc refuses prompt ids at
            or above it.
        num_kv_blocks: KV cache blocks the worker allocates.
        async_scheduling: plan step N+1 while step N runs.
        debug_token_cache_poison: poison consumed token-id cache entries and
            check every placeholder read (slower; tests turn it on).
        sim_step_us, sim_token_us: with ``model == "sim"``, the simulated
            device's step time ``A + B × tokens`` in microseconds.
        trace: record per-step spans for a Chrome-trace timeline; each
            process writes its spans to ``trace_path(role)`` when it exits.
        max_request_body_bytes: largest HTTP request body io_proc reads;
            a larger one is answered 413 before it is parsed.
        http_header_timeout_s: seconds a client has to send a request's
            headers, from the connection's opening (or the first byte of the
            next request on a kept-alive connection); then it is closed.
        http_body_timeout_s: seconds a client has to send a request's body
            once its headers are in; then it gets 408 and is closed.
        limit_concurrency: open HTTP connections plus running requests at
            which io_proc answers new requests with 503.
        step_timeout_s: seconds a step in flight may go without its output
            before the scheduler declares the worker hung and stops the
            server with a message; 0 disables the watchdog.
        debug_fail_step: the worker raises ``RuntimeError`` when it
            launches this step, as a failing forward pass would (the fault
            tests use it); -1: never.
        instance: unique id of this server instance (names of rings and sockets).
        ipc_dir: private directory holding this instance's zmq sockets.
    """

    model: str
    served_model_name: str
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    block_size: int = 16
    max_model_len: int = 2048
    num_kv_blocks: int = 1024
    vocab_size: int = 0
    async_scheduling: bool = True
    debug_token_cache_poison: bool = False
    sim_step_us: float = 10_000.0
    sim_token_us: float = 0.0
    tokenizer: str = ""
    trace: bool = False
    max_request_body_bytes: int = 4 * 2**20
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 60.0
    limit_concurrency: int = 4096
    step_timeout_s: float = 300.0
    debug_fail_step: int = -1
    instance: str = ""
    ipc_dir: str = ""

    @property
    def is_simulated(self) -> bool:
        """True when the simulated device replaces the model."""
        return self.model == "sim"

    def trace_path(self, role: str) -> str:
        """Where process ``role`` writes its trace spans (JSON list)."""
        return f"{self.ipc_dir}/trace-{role}.json"

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block-table row."""
        return cdiv(self.max_model_len, self.block_size)

    @property
    def descriptor_layout(self) -> Layout:
        return StepDescriptor.layout(self.max_num_seqs, self.max_num_batched_tokens, self.block_size)

    @property
    def output_layout(self) -> Layout:
        return StepOutput.layout(self.max_num_seqs, self.max_num_batched_tokens)

    @property
    def descriptor_ring_name(self) -> str:
        return f"/pipeline-{self.instance}-desc"

    @property
    def output_ring_name(self) -> str:
        return f"/pipeline-{self.instance}-out"

    def descriptor_ring(self, create: bool = False) -> ShmRing[StepDescriptor]:
        """The StepDescriptor ring (scheduler writes, worker reads); ``create`` in the launcher only."""
        return ShmRing(self.descriptor_ring_name, self.descriptor_layout, DESCRIPTOR_RING_SLOTS, 1, create,
                       StepDescriptor)

    def output_ring(self, create: bool = False) -> ShmRing[StepOutput]:
        """The StepOutput ring (worker writes; scheduler and io_proc read)."""
        return ShmRing(self.output_ring_name, self.output_layout, OUTPUT_RING_SLOTS, 2, create, StepOutput)

    @property
    def control_address(self) -> str:
        """zmq address of io_proc -> scheduler control messages."""
        return f"ipc://{self.ipc_dir}/to_scheduler"

    @property
    def reply_address(self) -> str:
        """zmq address of scheduler -> io_proc replies."""
        return f"ipc://{self.ipc_dir}/to_io"
