"""SGLang's ``/server_info`` and ``/model_info``: what SGLang's model gateway (``sglang-router``) reads from a
backend when it registers it (docs/design.md, "Behind a router").

The gateway asks both (then their older names, ``/get_server_info`` and
``/get_model_info``) and labels the worker with the model it serves; without
them it registers every backend as model ``unknown``. The fields are SGLang's
names for what this server has.
"""

from __future__ import annotations

from pipeline import __version__
from pipeline.common.config import EngineConfig


def server_info(config: EngineConfig) -> dict:
    """SGLang's ``/server_info`` fields (its server arguments) that this server has."""
    info = {
        "model_path": config.model,
        "tokenizer_path": config.tokenizer,
        "served_model_name": config.served_model_name,
        "tp_size": config.tensor_parallel_size,
        "dp_size": config.data_parallel_size,
        "max_running_requests": config.max_num_seqs,
        "max_prefill_tokens": config.max_num_batched_tokens,
        "context_length": config.max_model_len,
        "page_size": config.block_size,
        "disable_radix_cache": not config.enable_prefix_caching,
        "version": __version__,
    }
    if config.num_kv_blocks:  # 0 on CUDA until each worker has sized its cache
        info["max_total_tokens"] = config.num_kv_blocks * config.block_size
    return info


def model_info(config: EngineConfig) -> dict:
    """SGLang's ``/model_info``."""
    return {"model_path": config.model, "tokenizer_path": config.tokenizer, "is_generation": True}
