"""SGLang's ``/server_info``, ``/model_info`` and ``/get_load``: what SGLang's model gateway (``sglang-router``)
reads from a backend (docs/design.md, "Behind a router").

The gateway asks the first two (then their older names, ``/get_server_info``
and ``/get_model_info``) when it registers a backend, and labels it with the
model it serves; without them it registers every backend as model
``unknown``. Its power_of_two policy polls ``/get_load``. The fields are
SGLang's names for what this server has.
"""

from __future__ import annotations

from pipeline import __version__
from pipeline.common.config import EngineConfig
from pipeline.common.messages import Stats


def server_info(config: EngineConfig) -> dict:
    """SGLang's ``/server_info`` fields (its server arguments) that this server has."""
    info = {
        "model_path": config.model,
        "tokenizer_path": config.tokenizer,
        "served_model_name": config.served_model_name,
        "tp_size": config.parallel.tensor_parallel_size,
        "dp_size": config.parallel.data_parallel_size,
        "max_running_requests": config.scheduler.max_num_seqs,
        "max_prefill_tokens": config.scheduler.max_num_batched_tokens,
        "context_length": config.max_model_len,
        "page_size": config.scheduler.block_size,
        "disable_radix_cache": not config.scheduler.enable_prefix_caching,
        "version": __version__,
    }
    if config.num_kv_blocks:  # 0 on CUDA until each worker has sized its cache
        info["max_total_tokens"] = config.num_kv_blocks * config.scheduler.block_size
    return info


def model_info(config: EngineConfig) -> dict:
    """SGLang's ``/model_info``."""
    return {"model_path": config.model, "tokenizer_path": config.tokenizer, "is_generation": True}


def engine_loads(stats: list[Stats], block_size: int) -> list[dict]:
    """SGLang's ``/get_load``: per engine (its ``dp_rank``), the requests it holds and, as SGLang counts
    ``num_tokens``, the tokens in the KV blocks its running requests own (cached blocks no request owns are
    free to evict: not load) plus the tokens of the requests still waiting, which hold no blocks yet."""
    return [
        {
            "dp_rank": e,
            "num_reqs": s.num_running + s.num_waiting,
            "num_waiting_reqs": s.num_waiting,
            "num_tokens": (s.num_total_blocks - s.num_free_blocks) * block_size + s.num_waiting_tokens,
        }
        for e, s in enumerate(stats)
    ]
