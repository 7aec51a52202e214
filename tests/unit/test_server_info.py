"""SGLang's ``/get_load`` figures from the engines' Stats (``io_proc/server_info.py``)."""

from __future__ import annotations

from pipeline.common.messages import Stats
from pipeline.io_proc.server_info import engine_loads


def stats(running: int, waiting: int, free_blocks: int, waiting_tokens: int) -> Stats:
    return Stats(
        nonce=0,
        num_running=running,
        num_waiting=waiting,
        num_free_blocks=free_blocks,
        num_total_blocks=100,
        num_free_req_indices=0,
        num_total_req_indices=8,
        num_steps=0,
        num_preemptions=0,
        num_cached_blocks=40,
        num_waiting_tokens=waiting_tokens,
    )


def test_num_tokens_counts_owned_blocks_and_waiting_tokens():
    """As SGLang counts it: tokens in blocks that requests own (cached blocks that no request owns are free to
    evict, so not load) plus the waiting requests' tokens, which hold no blocks yet; one entry per engine."""
    loads = engine_loads([stats(2, 0, 90, 0), stats(1, 3, 95, 700)], block_size=16)
    assert loads == [
        {"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 0, "num_tokens": 10 * 16},
        {"dp_rank": 1, "num_reqs": 4, "num_waiting_reqs": 3, "num_tokens": 5 * 16 + 700},
    ]
