"""The StepOutput record, worker -> scheduler and io_proc, defined by the field table ``OUTPUT`` (docs/design.md, "The
step protocol")."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.common.layouts import Layout
from pipeline.common.records import Field, Group, Record
from pipeline.common.step_clock import WORKER_STATS_LEN

# The output ring is read by two processes at different paces; extra entries
# absorb io_proc falling behind for a few steps without stalling the worker.
OUTPUT_RING_ENTRIES = 16
# Reader indices on the output ring, which only worker rank 0 writes.
OUTPUT_READER_SCHEDULER, OUTPUT_READER_IO = 0, 1
# Alternatives returned per token with log-probabilities (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
# Why a request in a StepOutput's failed list ends, by its `failed_why` (docs/design.md, "Non-finite logits",
# "Multi-LoRA").
NONFINITE_LOGITS = "the model's logits were not finite (NaN or infinite): its output cannot be sampled"
LORA_UNREADABLE = (
    "the worker could not read its LoRA adapter (the server's copy of it is gone or damaged); load the adapter "
    "again with /v1/load_lora_adapter"
)
FAILURES = (NONFINITE_LOGITS, LORA_UNREADABLE)
NONFINITE, LORA_FAILED = range(len(FAILURES))

i32, i64, f32, u8 = np.int32, np.int64, np.float32, np.uint8

OUTPUT = Record(
    "StepOutput",
    header=(
        Field("step_id", i64, "the step's id"),
        Field(
            "num_rows",
            i64,
            "live output rows (S): per sampled descriptor row, in descriptor order, one row, or with drafts "
            "one per token it got (its accepted drafts, then the correction or bonus)",
        ),
        Field("num_logprob_rows", i64, "live log-probability rows (L)"),
        Field("num_prompt_entries", i64, "live prompt log-probabilities (P)"),
        Field("time_ns", i64, "the step's device end on `time.monotonic_ns()`'s clock: every token's engine timestamp"),
        Field("continues", i64, "the descriptor's flag"),
        Field("num_failed", i64, "requests that end with an error this step (F)"),
        Field("num_proposals", i64, "speculative decoding: sampled rows whose next drafts follow (D)"),
    ),
    groups=(
        Group(
            "worker_stats",
            "worker count",
            "WORKER_STATS_LEN",
            "WORKER_STATS_LEN",
            (Field("worker_stats", i64, "the worker's cumulative `WorkerClock` counts (`step_clock.py`)"),),
        ),
        Group(
            "rows",
            "output row",
            "max_output_rows",
            "num_rows",
            (
                Field("req_num", i64, "the request the token is for"),
                Field("token_id", i32, "the sampled token"),
                Field("draft_matched", u8, "speculative decoding: the proposer found drafts for its next step"),
            ),
        ),
        Group(
            "logprob_rows",
            "output row with log-probabilities",
            "max_output_rows",
            "num_logprob_rows",
            (
                Field("lp_row", i32, "the output row"),
                Field("lp_logprob", f32, "the sampled token's log-probability (raw model log-softmax)"),
                Field("lp_top_ids", i32, "the most likely tokens, descending", width="MAX_LOGPROBS"),
                Field("lp_top_logprobs", f32, "their log-probabilities", width="MAX_LOGPROBS"),
            ),
        ),
        Group(
            "prompt_entries",
            "prompt token with log-probabilities",
            "max_num_batched_tokens",
            "num_prompt_entries",
            (
                Field("pe_req_num", i64, "the request"),
                Field("pe_pos", i32, "the prompt token's position"),
                Field("pe_logprob", f32, "its log-probability"),
                Field("pe_top_ids", i32, "the most likely tokens at that position", width="MAX_LOGPROBS"),
                Field("pe_top_logprobs", f32, "their log-probabilities", width="MAX_LOGPROBS"),
            ),
        ),
        Group(
            "failed",
            "failed request",
            "max_output_rows",
            "num_failed",
            (
                Field(
                    "failed_req_num",
                    i64,
                    "a request that ends with an error; its rows in this output are dropped",
                ),
                Field(
                    "failed_why",
                    u8,
                    "why, an index of `FAILURES`: 0, a NaN or an infinity in a sampled position's logits; 1, its "
                    "LoRA adapter could not be read",
                ),
            ),
        ),
        Group(
            "proposals",
            "sampled row's proposed drafts",
            "max_output_rows",
            "num_proposals",
            (
                Field("pr_req_num", i64, "speculative decoding: a sampled row's request"),
                Field(
                    "pr_drafts",
                    i32,
                    "the drafts proposed for its next step, which a grammar's masks for that step check",
                    width="max_drafts",
                ),
            ),
        ),
    ),
    constants={"MAX_LOGPROBS": MAX_LOGPROBS, "WORKER_STATS_LEN": WORKER_STATS_LEN},
)


@dataclass
class TokenLogprobs:
    """Log-probabilities of ``N`` chosen tokens (raw log-softmax): ``logprob[i]``, and ``top_ids``/``top_logprobs[i,
    :k]`` descending (columns past ``k`` unspecified); ``index``: output rows, or request numbers for prompt tokens."""

    index: np.ndarray  # [N] int64
    logprob: np.ndarray  # [N] float32
    top_ids: np.ndarray  # [N, MAX_LOGPROBS] int32
    top_logprobs: np.ndarray  # [N, MAX_LOGPROBS] float32
    pos: np.ndarray | None = None  # [N] int64 position of each prompt token (prompt entries only)


@dataclass
class DecodedOutput:
    """One StepOutput copied out of its ring entry: row ``r`` gave ``token_ids[r]`` to ``req_nums[r]``.

    A verifying request has one consecutive row per token it got. ``draft_matched``: ``[rows]`` uint8; ``proposals``:
    ``(req_nums [D], drafts [D, K] int64)`` or None; ``failed``: requests that end with an error, before their rows,
    ``failed_why`` the index of each one's reason in ``FAILURES``.
    """

    step_id: int
    req_nums: list[int] | np.ndarray
    token_ids: list[int] | np.ndarray
    time_ns: int = 0
    continues: bool = False
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    draft_matched: np.ndarray | None = None
    failed: list[int] = field(default_factory=list)
    failed_why: list[int] = field(default_factory=list)
    proposals: tuple[list[int], np.ndarray] | None = None


_OUT = OUTPUT.header_index


class StepOutput(OUTPUT.view_base):
    """Typed views of one StepOutput ring entry (fields: ``OUTPUT``), with its writer and reader."""

    __slots__ = ()

    @staticmethod
    def layout(max_output_rows: int, max_num_batched_tokens: int, num_speculative_tokens: int = 0) -> Layout:
        """The entry layout for ``max_output_rows`` rows (``max_num_seqs`` times the most tokens a row gets: ``1 +
        num_speculative_tokens``) and a step of ``max_num_batched_tokens``."""
        dims = dict(max_output_rows=max_output_rows, max_num_batched_tokens=max_num_batched_tokens)
        return OUTPUT.layout(dims | dict(max_drafts=max(1, num_speculative_tokens)))

    def write(
        self,
        step_id: int,
        req_nums: np.ndarray,
        token_ids: np.ndarray,
        logprobs: TokenLogprobs | None = None,
        prompt_logprobs: TokenLogprobs | None = None,
        time_ns: int = 0,
        continues: bool = False,
        worker_stats: np.ndarray | None = None,
        draft_matched: np.ndarray | None = None,
        failed: np.ndarray | None = None,
        proposals: tuple[np.ndarray, np.ndarray] | None = None,
        failed_why: np.ndarray | None = None,
    ) -> None:
        """Fill the entry with step ``step_id``'s ``[S]`` request numbers and sampled token ids; None fields are left as
        they are (counts), 0 (``draft_matched``) or empty."""
        n = len(req_nums)
        h = self.header
        h[_OUT["step_id"]], h[_OUT["num_rows"]] = step_id, n
        h[_OUT["time_ns"]], h[_OUT["continues"]] = time_ns, continues
        if worker_stats is not None:
            self.worker_stats[:] = worker_stats
        self.req_num[:n] = req_nums
        self.token_id[:n] = token_ids
        self.draft_matched[:n] = 0 if draft_matched is None else draft_matched
        h[_OUT["num_failed"]] = 0 if failed is None else len(failed)
        if failed is not None:
            self.failed_req_num[: len(failed)] = failed
            self.failed_why[: len(failed)] = NONFINITE if failed_why is None else failed_why
        h[_OUT["num_proposals"]] = 0 if proposals is None else len(proposals[0])
        if proposals is not None:
            m, k = proposals[1].shape
            self.pr_req_num[:m] = proposals[0]
            self.pr_drafts[:m, :k] = proposals[1]
        h[_OUT["num_logprob_rows"]] = 0 if logprobs is None else len(logprobs.index)
        if logprobs is not None:
            m = len(logprobs.index)
            self.lp_row[:m] = logprobs.index
            self.lp_logprob[:m] = logprobs.logprob
            self.lp_top_ids[:m] = logprobs.top_ids
            self.lp_top_logprobs[:m] = logprobs.top_logprobs
        h[_OUT["num_prompt_entries"]] = 0 if prompt_logprobs is None else len(prompt_logprobs.index)
        if prompt_logprobs is not None:
            m = len(prompt_logprobs.index)
            self.pe_req_num[:m] = prompt_logprobs.index
            self.pe_pos[:m] = prompt_logprobs.pos
            self.pe_logprob[:m] = prompt_logprobs.logprob
            self.pe_top_ids[:m] = prompt_logprobs.top_ids
            self.pe_top_logprobs[:m] = prompt_logprobs.top_logprobs

    def read(self, logprobs: bool = False, drafts: bool = False, arrays: bool = False) -> DecodedOutput:
        """Copy the entry out (it may be released right after); log-probabilities and ``draft_matched`` only if asked;
        with ``arrays``, ``req_nums`` and ``token_ids`` as int64 arrays instead of lists."""
        h = self.header
        n = int(h[_OUT["num_rows"]])
        rows = (self.req_num[:n], self.token_id[:n])
        out = DecodedOutput(
            int(h[_OUT["step_id"]]),
            *(a.astype(np.int64) if arrays else a.tolist() for a in rows),
            int(h[_OUT["time_ns"]]),
            bool(h[_OUT["continues"]]),
        )
        if drafts:
            out.draft_matched = self.draft_matched[:n].copy()
            if m := int(h[_OUT["num_proposals"]]):
                out.proposals = (self.pr_req_num[:m].tolist(), self.pr_drafts[:m].astype(np.int64))
        if m := int(h[_OUT["num_failed"]]):
            out.failed, out.failed_why = self.failed_req_num[:m].tolist(), self.failed_why[:m].tolist()
        if logprobs:
            if m := int(h[_OUT["num_logprob_rows"]]):
                out.logprobs = TokenLogprobs(
                    self.lp_row[:m].astype(np.int64),
                    self.lp_logprob[:m].copy(),
                    self.lp_top_ids[:m].copy(),
                    self.lp_top_logprobs[:m].copy(),
                )
            if m := int(h[_OUT["num_prompt_entries"]]):
                out.prompt_logprobs = TokenLogprobs(
                    self.pe_req_num[:m].copy(),
                    self.pe_logprob[:m].copy(),
                    self.pe_top_ids[:m].copy(),
                    self.pe_top_logprobs[:m].copy(),
                    self.pe_pos[:m].astype(np.int64),
                )
        return out
