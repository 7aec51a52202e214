"""How many KV cache blocks a worker allocates when it sizes the cache (docs/design.md, "KV cache size"), as vLLM:

    KV bytes = total x gpu_memory_utilization - (total - free) - activation peak

after a profiling step; tensor-parallel ranks take the smallest figure, and a draft model's blocks count too.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from pipeline.common.config import EngineConfig
from pipeline.common.constants import cdiv
from pipeline.gpu_worker.attention.backend import StepLayout
from pipeline.gpu_worker.layers.tp import TPGroup
from pipeline.gpu_worker.models.base import CausalLM


def kv_cache_blocks(
    config: EngineConfig,
    model: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPGroup,
    draft: CausalLM | None = None,
) -> int:
    """Blocks of ``config.scheduler.block_size`` tokens this engine's KV cache (and ``draft``'s) holds on every rank.

    Raises:
        ValueError: not even one request of ``config.max_model_len`` fits; the message says what to change.
    """
    per_block = sum(
        m.config.kv_bytes_per_block(config.scheduler.block_size, dtype.itemsize, m.num_kv_heads)
        for m in (model, draft)
        if m is not None
    )
    if device.type == "cuda" and not config.kv_cache_memory_bytes:
        budget = profiled_kv_bytes(config, model, device, dtype)
        source = f"--gpu-memory-utilization {config.worker.gpu_memory_utilization} of {device}'s memory"
    else:
        budget = config.kv_cache_memory_bytes or 2 * 2**30
        source = "--kv-cache-memory"
    blocks = max(0, budget // per_block)
    if tp.size > 1:
        t = torch.tensor([blocks], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
        blocks = int(t.item())
    if blocks * (block_size := config.scheduler.block_size) < config.max_model_len:
        raise ValueError(
            f"the KV cache that {source} leaves holds {blocks} blocks of {block_size} tokens, fewer than "
            f"one request of --max-model-len {config.max_model_len} needs; raise --gpu-memory-utilization or "
            "--kv-cache-memory, lower --max-model-len or --max-num-batched-tokens, or free the device"
        )
    return blocks


@torch.inference_mode()
def profiled_kv_bytes(config: EngineConfig, model: CausalLM, device: torch.device, dtype: torch.dtype) -> int:
    """The KV cache's share of the device after a profiling step (see the module docstring); may be negative."""
    tokens = min(config.scheduler.max_num_batched_tokens, config.max_model_len)
    blocks = cdiv(tokens, config.scheduler.block_size)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    kv = model.allocate_kv_caches(blocks, config.scheduler.block_size, dtype, device)
    layout = StepLayout.build([tokens], [0], [0], config.scheduler.block_size, blocks)
    table = torch.arange(blocks, device=device)[None]
    meta = model.attn_backend.build_metadata(
        layout, table, lambda arrays: [torch.as_tensor(np.asarray(a, dtype=np.int64), device=device) for a in arrays]
    )
    hidden = model(torch.zeros(tokens, dtype=torch.int64, device=device), meta.positions, meta, kv)
    logits = model.compute_logits(hidden[: min(config.scheduler.max_num_seqs, tokens)])
    torch.softmax(logits, dim=-1)  # sampling works on [rows, vocab] float32 copies of the logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del kv, meta, hidden, logits
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    activations = peak - torch.cuda.memory_allocated(device)
    return int(total * config.worker.gpu_memory_utilization) - (total - free) - activations
