"""Parallel choices (``n`` > 1): one shared prefill, then each choice in its own row.

The choices share the KV blocks of the prompt's longest prefix of whole
blocks that leaves at least one prompt token: a shared prefill computes it
once, and each choice then computes the rest of the prompt itself, in its
own blocks (docs/design.md, "Parallel choices").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from msgspec.structs import replace

from pipeline.common.grammar import GrammarState
from pipeline.common.messages import AddRequest, SamplingParams, choice_seed
from pipeline.scheduler_proc.kv_block_pool import BlockPool
from pipeline.scheduler_proc.request import Request


def make_choices(
    msg: AddRequest, block_size: int, new_grammar: Callable[[SamplingParams], GrammarState | None]
) -> tuple[list[Request], Request | None]:
    """The ``msg.n`` choices (``req_num + 1 + i``, seeded ``seed + i``) and their shared prefill.

    The prefill is None when the choices run as independent requests: no
    whole block of the prompt to share, or prompt log-probabilities (each
    choice reports its own).
    """
    prompt = list(msg.prompt_token_ids)
    choices = [
        Request(
            msg.req_num + 1 + i,
            prompt,
            replace(msg.params, seed=choice_seed(msg.params.seed, i)),
            new_grammar(msg.params),
        )
        for i in range(msg.n)
    ]
    shared = (len(prompt) - 1) // block_size * block_size
    if shared == 0 or msg.params.prompt_logprobs >= 0:
        return choices, None
    prefill = Request(msg.req_num, prompt[:shared], msg.params)
    prefill.choices = choices
    for c in choices:
        c.parent = prefill
    return choices, prefill


def fork(prefill: Request, pool: BlockPool) -> list[Request]:
    """The shared prefill is planned: its choices, in order, take its blocks and start after its prefix.

    Steps run in order on the device, so a choice planned in a later step
    reads the prefix's KV already written. The caller queues them first in
    line and removes the prefill.
    """
    choices, prefill.choices = prefill.choices, []
    for c in choices:
        pool.share(prefill.block_ids)
        c.block_ids = list(prefill.block_ids)
        c.num_computed_tokens = prefill.num_known_tokens
        c.parent = None
    return choices


def unshare(waiting: Iterable[Request], pool: BlockPool) -> None:
    """Waiting choices give back the prefix blocks they inherited, and will compute their prompts whole.

    Only when nothing runs: then nothing else would ever free blocks for the waiting head.
    """
    for req in waiting:
        if req.block_ids and req.num_placeholders == 0:
            pool.free_after(req.last_step_id, req.block_ids)
            req.block_ids, req.num_computed_tokens = [], 0
