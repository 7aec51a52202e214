"""The scheduler's state of one request (docs/design.md, "The scheduler")."""

from __future__ import annotations

import time
from array import array

from pipeline.common.messages import SamplingParams
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID
from pipeline.scheduler_proc.grammar_state import GrammarState


class Request:
    """Scheduler-side state of one request (docs/design.md, "Speculative decoding"; "Prefix caching"; "Metrics").

    ``num_placeholders``: tokens sampled in steps whose output has not arrived; ``req_index`` -1 when not running;
    ``block_hashes``: names of its full blocks, the first ``num_named_blocks`` named in the pool. While a steady row,
    ``SteadyRows`` owns its progress and those fields are None here (a stray read fails).
    """

    __slots__ = (
        "req_num",
        "prompt_token_ids",
        "output_token_ids",
        "params",
        "num_computed_tokens",
        "num_placeholders",
        "num_rejected",
        "req_index",
        "block_ids",
        "last_step_id",
        "is_new",
        "admit_seq",
        "block_hashes",
        "num_named_blocks",
        "grammar",
        "proposed_drafts",
        "queued_ns",
        "scheduled_ns",
        "first_token_ns",
        "lora_slot",
    )

    def __init__(
        self, req_num: int, prompt_token_ids: list[int], params: SamplingParams, grammar: GrammarState | None = None
    ):
        self.req_num = req_num
        self.prompt_token_ids = prompt_token_ids
        # int32 ids: a request that ends frees one buffer, not an object per token (at batch 1024 a few
        # dozen requests of hundreds of tokens can end in one step).
        self.output_token_ids = array("i")
        self.params = params
        self.num_computed_tokens = 0
        self.num_placeholders = 0
        self.num_rejected = 0
        self.req_index = -1
        self.block_ids: list[int] = []
        self.last_step_id = -1
        self.is_new = True
        self.admit_seq = -1
        self.block_hashes: list[bytes] = []
        self.num_named_blocks = 0
        self.grammar = grammar
        self.proposed_drafts = None  # with a grammar and drafts: those its next row reads (its latest output's)
        self.queued_ns = time.monotonic_ns()
        self.scheduled_ns = 0
        self.first_token_ns = 0
        self.lora_slot = 0  # the adapter slot it holds while running (``LoraSlots``)

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus output tokens whose ids the scheduler has."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_outputs_planned(self) -> int:
        """Output tokens received plus those sampled in steps in flight."""
        return len(self.output_token_ids) + self.num_placeholders

    def samples(self, end: int) -> bool:
        """Whether a row computing up to ``end`` samples: only the chunk reaching the last known token, never with
        ``max_tokens`` 0."""
        return end >= self.num_known_tokens and self.params.max_tokens > 0

    def chunk(self, pos: int, k: int) -> list[int]:
        """Token ids at positions ``pos .. pos + k - 1``; a single token may be the placeholder."""
        if k == 1:
            p = len(self.prompt_token_ids)
            if pos < p:
                return [self.prompt_token_ids[pos]]
            if pos - p < len(self.output_token_ids):
                return [self.output_token_ids[pos - p]]
            return [PLACEHOLDER_TOKEN_ID]
        # A prefill chunk: every id is known.
        if pos + k > len(self.prompt_token_ids):
            return (self.prompt_token_ids + self.output_token_ids.tolist())[pos : pos + k]
        return self.prompt_token_ids[pos : pos + k]

    def prompt_logprob_span(self, pos: int, k: int) -> tuple[int, int]:
        """For a row of ``k`` tokens from ``pos``: how many positions predict a wanted prompt logprob, and the prompt
        token after the row when all do (else -1)."""
        if self.params.prompt_logprobs < 0:
            return 0, -1
        n = max(0, min(k, len(self.prompt_token_ids) - 1 - pos))
        return n, self.prompt_token_ids[pos + k] if n == k else -1
