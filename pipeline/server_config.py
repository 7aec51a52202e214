"""The ``EngineConfig`` that ``pipeline-serve``'s flags make: ``make_config`` resolves the model,
derives the sizes (max model length, KV cache blocks, device) and checks them; a bad value exits
with a message naming the flag."""

from __future__ import annotations

import argparse
import json
import os
import secrets
from pathlib import Path

import msgspec

from pipeline.common import config_groups
from pipeline.common.config import (
    SPECULATIVE_METHODS,
    EngineConfig,
    LoraConfig,
    LoraModule,
    QuantizationConfig,
    SpeculativeConfig,
)
from pipeline.common.config_groups import ParallelConfig
from pipeline.common.flags import die
from pipeline.common.instance_files import make_ipc_dir, sweep_dead_instances
from pipeline.common.kv_events import KVEventsConfig, parse_kv_events_config
from pipeline.common.model_flags import LoraFlags, ModelFlags
from pipeline.server_args import group_from_args

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
        die(f"--cuda-graph-sizes must be positive, got {requested}")
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
        die(f'{flag} is not JSON ({e}); e.g. \'{{"method": "ngram", "num_speculative_tokens": 4}}\'')
    if not isinstance(raw, dict):
        die(f"{flag} must be a JSON object")
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
    unknown = sorted(set(raw) - known)
    if unknown:
        die(f"{flag}: unsupported key {unknown[0]!r}; the keys are {', '.join(sorted(known))}")
    method = raw.get("method", "draft_model" if "model" in raw else None)
    if method not in SPECULATIVE_METHODS:
        die(f"{flag}: method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    k = raw.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        die(f"{flag}: num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, got {k!r}")
    lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            die(f"{flag}: {name} must be an integer >= 1, got {v!r}")
    lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
    if lo > hi:
        die(f"{flag}: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    if method == "draft_model":
        if "prompt_lookup_min" in raw or "prompt_lookup_max" in raw:
            die(f"{flag}: prompt_lookup_min and prompt_lookup_max are for method ngram only")
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            die(f"{flag}: method draft_model needs model, the draft model's directory (or .gguf file)")
        return SpeculativeConfig(method, k, model=model)
    if "model" in raw:
        die(f"{flag}: model is for method draft_model only")
    return SpeculativeConfig(method, k, lo, hi)


def parse_lora_module(text: str) -> LoraModule:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON ``{"name": ..., "path": ...}``; exits
    with a message on anything else."""
    if text.lstrip().startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            die(f"--lora-modules: {text!r} is not JSON ({e})")
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
            die(f'--lora-modules: {text!r} must be {{"name": NAME, "path": PATH}}')
        name, path = raw["name"], raw["path"]
    else:
        name, _, path = text.partition("=")
    if not name or not path:
        die(f"--lora-modules: {text!r} must be NAME=PATH or vLLM's JSON form")
    return LoraModule(name, path)


def make_lora_config(lf: LoraFlags, served_name: str, model) -> LoraConfig | None:
    """``--enable-lora`` and its flags as a ``LoraConfig``, each ``--lora-modules`` adapter read and
    checked against the base ``model`` (a ModelConfig); None when off. Exits with a message naming the
    flag or the adapter."""
    given = [f for f in ("lora_modules", "max_cpu_loras") if getattr(lf, f) is not None]
    if not lf.enable_lora:
        if given or lf.allow_runtime_lora_updating:
            die(f"--{given[0].replace('_', '-') if given else 'allow-runtime-lora-updating'} needs --enable-lora")
        return None
    if model is None:
        die("--enable-lora needs a model (the simulated device has no layers to adapt)")
    if lf.max_loras < 1 or lf.max_lora_rank < 1:
        die("--max-loras and --max-lora-rank must be positive")
    max_cpu = lf.max_cpu_loras if lf.max_cpu_loras is not None else lf.max_loras
    if max_cpu < lf.max_loras:
        die(f"--max-cpu-loras ({max_cpu}) must be at least --max-loras ({lf.max_loras})")
    modules = tuple(parse_lora_module(t) for t in lf.lora_modules or ())
    names = [m.name for m in modules]
    if len(set(names)) != len(names) or served_name in names:
        die(f"--lora-modules: adapter names must differ from each other and from the model's ({served_name!r})")
    from pipeline.common.lora_checkpoint import LoraError, check_adapter

    for m in modules:
        try:
            check_adapter(m.path, model, lf.max_lora_rank)
        except LoraError as e:
            die(f"--lora-modules {m.name}: {e}")
    runtime = lf.allow_runtime_lora_updating or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in (
        "1",
        "true",
    )
    return LoraConfig(modules, lf.max_loras, lf.max_lora_rank, max_cpu, runtime)


def check_draft_model(spec: SpeculativeConfig, target_dir: Path, target, max_model_len: int, tp: int):
    """``(spec with the draft's Hugging Face directory, the draft's ModelConfig)``; exits with a message
    naming both models when the draft cannot serve the target (another vocabulary, too few positions,
    a ``-tp`` it does not split into)."""
    from pipeline.common.model_files import check_checkpoint, read_model_config, resolve_model, tokenizer_vocabulary

    flag = "--speculative-config"
    try:
        draft_dir = resolve_model(spec.model)[0]
        draft = read_model_config(draft_dir)
        check_checkpoint(draft_dir)
        vocabularies = tokenizer_vocabulary(target_dir), tokenizer_vocabulary(draft_dir)
    except (FileNotFoundError, ValueError, OSError) as e:
        die(f"{flag}: draft model: {e}".replace("--model ", "model "))
    if draft.vocab_size != target.vocab_size:
        die(
            f"{flag}: the draft model {draft_dir} has a vocabulary of {draft.vocab_size} tokens and the model "
            f"{target_dir} one of {target.vocab_size}: a draft model must have the model's tokenizer"
        )
    if None not in vocabularies and vocabularies[0] != vocabularies[1]:
        die(
            f"{flag}: the tokenizer files of the draft model {draft_dir} map token ids to other tokens than "
            f"those of the model {target_dir}: a draft model must have the model's tokenizer"
        )
    if draft.max_position_embeddings and draft.max_position_embeddings < max_model_len:
        die(
            f"{flag}: the draft model {draft_dir} has max_position_embeddings {draft.max_position_embeddings}, "
            f"below --max-model-len {max_model_len}; lower --max-model-len"
        )
    if tp > 1:
        try:
            draft.tp_shape(tp)
        except ValueError as e:
            die(f"{flag}: the draft model {draft_dir} does not split over --tensor-parallel-size {tp}: {e}")
    return msgspec.structs.replace(spec, model=str(draft_dir)), draft


def kv_events_config(text: str | None) -> KVEventsConfig | None:
    """``--kv-events-config``'s JSON; None when not given or off. Exits with a message naming the key."""
    if text is None:
        return None
    try:
        return parse_kv_events_config(text)
    except ValueError as e:
        die(f"--kv-events-config: {e}")


def _check_nodes(parallel: ParallelConfig) -> None:
    """Exit with a message on a multi-node combination that cannot run (docs/design.md, "Parallelism")."""
    nnodes, tp, dp = parallel.nnodes, parallel.tensor_parallel_size, parallel.data_parallel_size
    node_rank = parallel.node_rank
    if not 0 <= node_rank < nnodes:
        die(f"--node-rank {node_rank} is not a node of --nnodes {nnodes}: nodes are numbered 0 .. {nnodes - 1}")
    if nnodes == 1:
        return
    if tp % nnodes:
        die(
            f"--nnodes {nnodes} does not divide --tensor-parallel-size {tp}: every node runs the same number "
            f"of ranks; use a size that is a multiple of {nnodes}"
        )
    if not parallel.master_addr:
        die(
            f"--nnodes {nnodes} needs --master-addr: the address of the head node (--node-rank 0), where the ranks meet"
        )
    if dp > 1:
        die(
            "--nnodes > 1 spreads one engine's tensor-parallel ranks over machines; it does not combine with "
            "--data-parallel-size"
        )


def make_config(args: argparse.Namespace, **flags) -> EngineConfig:
    """Build each flag group, resolve the model and derive sizes; exits with a message on bad flags.

    Args:
        args: flags parsed by ``build_parser``'s parser (or one extending it).
        **flags: values to use instead of parsed ones, by field name (``max_num_seqs=...``),
            before any size is derived from them; ``args`` is left as parsed.
    """
    from pipeline.common.families import supported_architectures
    from pipeline.common.model_files import (
        check_checkpoint,
        check_tokenizer,
        checkpoint_dtype,
        read_model_config,
        resolve_model,
        resolve_quantization,
    )

    if unknown := flags.keys() - vars(args).keys():
        raise TypeError(f"make_config: no such flags: {sorted(unknown)}")
    args = argparse.Namespace(**{**vars(args), **flags})
    m = group_from_args(ModelFlags, args)
    groups = {name: group_from_args(group, args) for name, group in config_groups.GROUPS.items()}
    scheduler, worker, parallel = groups["scheduler"], groups["worker"], groups["parallel"]
    sim = m.model == "sim"
    try:
        model_dir, name = resolve_model(None if sim else m.model)
        cfg = read_model_config(model_dir)
        if not sim:
            check_checkpoint(model_dir)
            check_tokenizer(model_dir)
    except (FileNotFoundError, ValueError, OSError) as e:
        die(str(e))
    max_positions = cfg.max_position_embeddings
    max_model_len = m.max_model_len or min(max_positions or 8192, 8192)
    if max_model_len < 2:
        die("--max-model-len must be at least 2")
    if not sim and max_positions and max_model_len > max_positions:
        # A position past the model's RoPE table is an asynchronous device assert on CUDA.
        die(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {max_positions}; "
            f"use at most {max_positions}"
        )
    tp = parallel.tensor_parallel_size
    dp = parallel.data_parallel_size
    _check_nodes(parallel)
    kv_heads = None
    if not sim and tp > 1:
        try:
            kv_heads = cfg.tp_shape(tp).num_kv_heads
        except ValueError as e:
            die(f"--tensor-parallel-size: {e}")
    if m.trust_remote_code:
        die(
            "--trust-remote-code is not supported: this server never runs modelling code shipped with a "
            f"checkpoint; it serves these architectures with its own code: {', '.join(supported_architectures())}"
        )
    if scheduler.max_grammar_memory_mb < scheduler.max_grammar_memory_per_request_mb:
        die(
            f"--max-grammar-memory ({scheduler.max_grammar_memory_mb} MiB) must be at least "
            f"--max-grammar-memory-per-request ({scheduler.max_grammar_memory_per_request_mb} MiB)"
        )
    if groups["tools"].enable_auto_tool_choice and not groups["tools"].tool_call_parser:
        die("--enable-auto-tool-choice needs --tool-call-parser: the format the model writes calls in")
    device = m.device
    if sim:
        device = "cpu"  # the simulated device is host code
    elif device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = m.dtype
    if dtype == "auto":
        dtype = checkpoint_dtype(model_dir, cfg) if device == "cuda" and not sim else "float32"
    quantization = QuantizationConfig()
    if not sim:
        try:
            quantization = resolve_quantization(m.quantization, m.quantization_group_size, m.model, model_dir, cfg)
        except ValueError as e:
            die(str(e))
    speculative = parse_speculative_config(m.speculative_config)
    kv_events = kv_events_config(m.kv_events_config)
    served_name = m.served_model_name or ("sim" if sim else name)
    lora = make_lora_config(group_from_args(LoraFlags, args), served_name, None if sim else cfg)
    draft = None
    if speculative is not None and speculative.method == "draft_model" and not sim:
        speculative, draft = check_draft_model(speculative, model_dir, cfg, max_model_len, tp)
    block_size = scheduler.block_size
    if m.num_kv_blocks:
        num_blocks = m.num_kv_blocks
    elif sim:  # nothing is allocated: enough blocks that the simulation never preempts
        num_blocks = scheduler.max_num_seqs * -(-max_model_len // block_size)
    elif device == "cuda" and m.kv_cache_memory is None:
        num_blocks = 0  # each worker sizes its cache from --gpu-memory-utilization after a profiling step
    else:
        per_block = cfg.kv_bytes_per_block(block_size, _DTYPE_BYTES[dtype], kv_heads)
        if draft is not None:  # its cache holds the same blocks
            draft_heads = draft.tp_shape(tp).num_kv_heads if tp > 1 else None
            per_block += draft.kv_bytes_per_block(block_size, _DTYPE_BYTES[dtype], draft_heads)
        num_blocks = int((m.kv_cache_memory or 2.0) * 2**30 // per_block)
    if num_blocks and num_blocks * block_size < max_model_len:
        die(
            f"the KV cache ({num_blocks} blocks of {block_size} tokens) cannot hold one request of "
            f"--max-model-len {max_model_len}; raise --kv-cache-memory or lower --max-model-len"
        )
    chat_template = ""
    if m.chat_template:
        try:
            chat_template = Path(m.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            die(f"--chat-template {m.chat_template!r} cannot be read: {e}")
    # Graphs are captured on CUDA with one rank only (docs/design.md, "CUDA graphs for decode").
    graph_sizes = cuda_graph_sizes(
        worker.cuda_graph_sizes, min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
    )
    if worker.enforce_eager or device != "cuda" or tp > 1:
        graph_sizes = ()
    local = tp // parallel.nnodes * dp  # ranks this machine runs
    if device == "cuda" and local > 1:
        import torch

        if local > torch.cuda.device_count():
            die(
                f"--tensor-parallel-size {tp} x --data-parallel-size {dp} / --nnodes {parallel.nnodes} needs "
                f"{local} CUDA devices on this node (one per rank), found {torch.cuda.device_count()}"
            )
    attention_backend = worker.attention_backend
    if speculative is not None and scheduler.async_scheduling and device == "cuda":
        # FlashInfer plans from exact host context lengths; with speculation only the device has them.
        if attention_backend == "flashinfer":
            die(
                "--attention-backend flashinfer needs every context length on the host, which speculative "
                "decoding with asynchronous scheduling only has on the device: use torch_bucketed"
            )
        if attention_backend == "auto":
            attention_backend = "torch_bucketed"
    groups["worker"] = msgspec.structs.replace(
        worker, attention_backend=attention_backend, cuda_graph_sizes=graph_sizes
    )
    # What launchers killed by SIGKILL left behind (their children remove it too, unless they died alike).
    sweep_dead_instances()
    return EngineConfig(
        model="sim" if sim else str(model_dir),
        tokenizer=str(model_dir),
        served_model_name=served_name,
        dtype=dtype,
        quantization=quantization,
        device=device,
        max_model_len=max_model_len,
        num_kv_blocks=num_blocks,
        kv_cache_memory_bytes=int((m.kv_cache_memory or 0) * 2**30),
        vocab_size=cfg.vocab_size,
        speculative=speculative,
        lora=lora,
        kv_events=kv_events,
        chat_template=chat_template,
        trace=bool(groups["observability"].trace_file),
        instance=f"{os.getpid()}-{secrets.token_hex(4)}",
        ipc_dir=make_ipc_dir(),
        **groups,
    )
