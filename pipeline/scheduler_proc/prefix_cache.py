"""Prefix caching on the scheduler's side: naming final blocks, finding a new request's cached prefix.

docs/design.md, "Prefix caching". The pool keeps the named blocks
(``BlockPool``); this module
decides which of a request's blocks may be named and which it may reuse.

A request's first ``num_final_tokens`` tokens are final: their ids are
known (no placeholder, no token of a step in flight) and their keys and
values are written or planned in a step already built, so any later step
reads them. Only blocks made of final tokens are named, once each, in
order; everything past them is provisional.
"""

from __future__ import annotations

from array import array

from pipeline.common.block_hash import adapter_root, hash_blocks
from pipeline.scheduler_proc.kv_block_pool import BlockPool
from pipeline.scheduler_proc.kv_event_publisher import KVEventPublisher
from pipeline.scheduler_proc.request import Request


def num_final_tokens(req: Request) -> int:
    """Tokens of ``req`` whose ids are known and whose keys and values are written or planned."""
    return min(req.num_known_tokens, req.num_computed_tokens)


class PrefixCache:
    """Names a request's final blocks in the pool and looks its prompt up; counts queries and hits in tokens.

    Args:
        pool: the block pool; its ``enable_caching`` turns all of this off.
        block_size: tokens per KV block.
        root: the parent name of a first block (``EngineConfig.block_hash_root``), under
            ``adapter_root`` for a request with a LoRA adapter.
    """

    def __init__(self, pool: BlockPool, block_size: int, root: bytes):
        self.pool, self.block_size, self.root = pool, block_size, root
        self.num_queries = self.num_hits = 0  # prompt tokens looked up and found, since the start
        # Hears of each run of blocks named (docs/design.md, "KV-cache events").
        self.events: KVEventPublisher | None = None

    @property
    def enabled(self) -> bool:
        return self.pool.enable_caching

    def name_prompt(self, req: Request) -> None:
        """Name the full blocks of ``req``'s prompt (what its lookup needs); O(prompt blocks), once."""
        if self.enabled:
            root = adapter_root(self.root, req.params.lora_id)
            req.block_hashes = hash_blocks(array("i", req.prompt_token_ids), self.block_size, root)

    def lookup(self, req: Request) -> list[int]:
        """The cached blocks ``req`` may start from; takes nothing (the caller shares them when it admits ``req``).

        At most every full block before its last known token: the logits of
        that token are needed, so it is always computed (as vLLM does). None
        for a request whose step inputs must include its prompt: prompt
        log-probabilities need every position's logits, and the worker
        builds the repetition penalty's prompt tokens, and a re-admitted
        request's presence and frequency counts, from the tokens it computes
        (docs/design.md, "Penalties and biases").
        """
        if not self.enabled or not may_reuse(req):
            return []
        return self.pool.lookup(req.block_hashes[: (req.num_known_tokens - 1) // self.block_size])

    def count(self, req: Request, hit: list[int]) -> None:
        """``req`` was admitted with ``hit`` after looking up its known tokens."""
        if self.enabled and may_reuse(req):
            self.num_queries += req.num_known_tokens
            self.num_hits += len(hit) * self.block_size

    def name_final(self, req: Request, final: int, block_ids: list[int] | None = None) -> None:
        """Name ``req``'s blocks that its first ``final`` tokens fill and that are not named yet; O(new blocks).

        ``block_ids``: its blocks, if no longer ``req.block_ids`` (an ended request whose free is deferred).
        """
        block_ids = req.block_ids if block_ids is None else block_ids
        bs = self.block_size
        done = req.num_named_blocks
        if final < (done + 1) * bs or not self.enabled:  # the common case: no block filled since
            return
        full = min(final // bs, len(block_ids))
        if full <= done:
            return
        names = req.block_hashes
        if len(names) < full:  # blocks of output tokens: named only now that they are final
            start, end, p = len(names) * bs, full * bs, len(req.prompt_token_ids)
            tokens = array("i", req.prompt_token_ids[start:end]) if start < p else array("i")
            tokens += req.output_token_ids[max(0, start - p) : max(0, end - p)]
            names += hash_blocks(tokens, bs, names[-1] if names else adapter_root(self.root, req.params.lora_id))
        named = self.pool.cache_blocks(block_ids[done:full], names[done:full])
        if named and self.events is not None:
            self._publish_stored(req, [done + i for i in named])
        req.num_named_blocks = full

    def _publish_stored(self, req: Request, blocks: list[int]) -> None:
        """Tell ``events`` of ``req``'s blocks ``blocks`` (ascending), now named: one event per consecutive run."""
        names, bs, p = req.block_hashes, self.block_size, len(req.prompt_token_ids)
        start = 0
        for k in range(1, len(blocks) + 1):
            if k < len(blocks) and blocks[k] == blocks[k - 1] + 1:
                continue
            first, end = blocks[start], blocks[k - 1] + 1
            lo, hi = first * bs, end * bs
            tokens = list(req.prompt_token_ids[lo:hi]) + req.output_token_ids[max(0, lo - p) : max(0, hi - p)].tolist()
            self.events.stored(names[first:end], names[first - 1] if first else None, tokens, req.params.lora_id)
            start = k


def may_reuse(req: Request) -> bool:
    """Whether ``req`` may start from cached blocks (see ``PrefixCache.lookup``)."""
    p = req.params
    if p.prompt_logprobs >= 0 or p.repetition_penalty != 1.0:
        return False
    return not (len(req.output_token_ids) and (p.presence_penalty or p.frequency_penalty))
