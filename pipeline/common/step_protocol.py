"""The step protocol's wire format: what crosses the two rings once per step.

``StepDescriptor`` (scheduler -> worker) says what to compute in step N;
``StepOutput`` (worker -> scheduler and io_proc) the tokens it sampled
(docs/design.md, "The step protocol"). Each is defined by one field table
below; docs/step-protocol.md is generated from them. The scheduler writes
descriptors with ``descriptor_builder.DescriptorBuilder``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.common.layouts import Layout
from pipeline.common.records import Field, Group, HostCopy, Record
from pipeline.common.step_clock import WORKER_STATS_LEN

# Token id meaning "the token this request sampled in the previous step"; the
# worker resolves it from its on-device token-id cache.
PLACEHOLDER_TOKEN_ID = -1
# Token id meaning "this row's next draft": the worker takes it from the drafts
# it proposed for the row at the end of the row's previous step
# (docs/design.md, "Speculative decoding").
DRAFT_TOKEN_ID = -2

# Steps in flight with asynchronous scheduling: N runs on the device while
# N+1 is queued behind it (docs/design.md, "The in-flight limit"). Lock step
# keeps one.
MAX_INFLIGHT_STEPS = 2
# Two spare descriptor entries beyond the in-flight limit let the scheduler
# publish N+2's entry while the worker still holds the entry it is reading.
DESCRIPTOR_RING_ENTRIES = MAX_INFLIGHT_STEPS + 2
# The output ring is read by two processes at different paces; extra entries
# absorb io_proc falling behind for a few steps without stalling the worker.
OUTPUT_RING_ENTRIES = 16
# Alternatives returned per token with log-probabilities (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
# Parameters travel once, in fixed-size fields, so the variable-size ones are
# bounded (io_proc refuses more with a 400): per descriptor entry at 256 rows
# they cost 0.6 MiB and 32 KiB.
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 32
# Rows per step that carry a token bitmask (structured output): each takes
# ceil(V / 32) int32 words, 6 KiB at 49,152 tokens and 16 KiB at 128,256, so
# the count is bounded; a constrained row beyond it waits a step.
MAX_MASKED_ROWS = 32
# Bits per bitmask word: the packed layout of llguidance and xgrammar (token
# ``t`` is allowed when bit ``t % 32`` of word ``t // 32`` is set).
MASK_BITS = 32
# Reader indices. On the descriptor ring, worker rank r reads as reader r
# (rank 0 alone without tensor parallelism). On the output ring, which only
# rank 0 writes, the scheduler and io_proc.
OUTPUT_READER_SCHEDULER, OUTPUT_READER_IO = 0, 1

i32, i64, f32, u8 = np.int32, np.int64, np.float32, np.uint8

DESCRIPTOR = Record(
    "StepDescriptor",
    header=(
        Field("step_id", i64, "the step's id, counting up from 0"),
        Field("num_reqs", i64, "live request rows (R)"),
        Field("num_tokens", i64, "live tokens (T)"),
        Field("num_new_blocks", i64, "live new block-table entries (B)"),
        Field("num_masks", i64, "live token bitmasks (M)"),
        Field("mask_words", i64, "int32 words of one bitmask, `ceil(vocab / 32)`; 0 without a model"),
        Field("continues", i64, "1 when a row's request ran before: the gap before the step is the host's"),
    ),
    groups=(
        Group(
            "rows",
            "request row",
            "max_num_seqs",
            "num_reqs",
            (
                Field("req_num", i64, "the request's number, unique for the server's life"),
                Field("req_index", i32, "its row in the worker's per-request tables"),
                Field("num_scheduled_tokens", i32, "its tokens in this step (its share of `token_ids`)"),
                Field("start_pos", i32, "position of its first scheduled token"),
                Field("do_sample", u8, "a token is sampled from its last scheduled position", rows="sample_rows"),
                Field("is_new", u8, "its first row at this req_index: the new-row fields are set", rows="new_rows"),
                Field("num_prompt_logprobs", i32, "positions, from its first, that predict a wanted prompt token"),
                Field(
                    "next_prompt_token",
                    i32,
                    "the prompt token after its last position when that one is wanted, else -1",
                ),
                Field(
                    "num_draft_tokens",
                    i32,
                    "its last scheduled tokens that are drafts to verify (DRAFT_TOKEN_ID), each sampled",
                ),
                Field(
                    "num_rejected",
                    i32,
                    "its request's drafts rejected since it became new at this req_index that `start_pos` "
                    "accounts for; the worker moves the row back by those only it knows yet",
                ),
            ),
        ),
        Group(
            "sampling",
            "new row",
            "max_num_seqs",
            "num_reqs",
            (
                Field("temperature", f32, "0 is greedy"),
                Field("top_p", f32, "nucleus mass in (0, 1]"),
                Field("top_k", i32, "0 is off"),
                Field("seed", i64, "63-bit seed of the sampling noise"),
                Field("logprobs", i32, "alternatives per sampled token; -1 for no log-probabilities"),
                Field("prompt_logprobs", i32, "alternatives per prompt token; -1 for none"),
                Field("presence_penalty", f32, "OpenAI's; 0 is off"),
                Field("frequency_penalty", f32, "OpenAI's; 0 is off"),
                Field("repetition_penalty", f32, "vLLM's; 1 is off"),
                Field("min_p", f32, "0 is off"),
                Field("min_tokens", i32, "stop ids are masked before this many output tokens"),
            ),
            select="new_rows",
            meaning="Set where `is_new`, from the SamplingParams attributes of the same names",
        ),
        Group(
            "new_rows",
            "new row",
            "max_num_seqs",
            "num_reqs",
            (
                Field("prompt_len", i32, "positions from it on hold output tokens (penalties count them)"),
                Field("num_logit_bias", i32, "live entries of the next two"),
                Field("logit_bias_ids", i32, "token ids of its logit_bias", width="MAX_LOGIT_BIAS"),
                Field("logit_bias_values", f32, "the biases", width="MAX_LOGIT_BIAS"),
                Field("num_stop_ids", i32, "live entries of the next one (0 unless min_tokens masks them)"),
                Field("stop_ids", i32, "the stop token ids min_tokens masks", width="MAX_STOP_TOKEN_IDS"),
            ),
            select="new_rows",
            meaning="Set where `is_new`",
        ),
        Group(
            "tokens",
            "token",
            "max_num_batched_tokens",
            "num_tokens",
            (Field("token_ids", i32, "request-major; a real id, PLACEHOLDER_TOKEN_ID or DRAFT_TOKEN_ID"),),
        ),
        Group(
            "new_blocks",
            "new block-table entry",
            "max_new_blocks",
            "num_new_blocks",
            (
                Field("nb_req_index", i32, "`block_table[nb_req_index, nb_index] = nb_block` before the step runs"),
                Field("nb_index", i32, "the block-table column"),
                Field("nb_block", i32, "the KV block id"),
            ),
        ),
        Group(
            "masks",
            "masked row",
            "MAX_MASKED_ROWS",
            "num_masks",
            (
                Field("mask_row", i32, "the (sampled) request row the mask constrains"),
                Field(
                    "bitmask", i32, "bit t % 32 of word t // 32 set: token t allowed", width="mask_words", widen=False
                ),
            ),
        ),
    ),
    constants={
        "MAX_LOGIT_BIAS": MAX_LOGIT_BIAS,
        "MAX_STOP_TOKEN_IDS": MAX_STOP_TOKEN_IDS,
        "MAX_MASKED_ROWS": MAX_MASKED_ROWS,
    },
)

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
    ),
    constants={"MAX_LOGPROBS": MAX_LOGPROBS, "WORKER_STATS_LEN": WORKER_STATS_LEN},
)


# Whole block-table rows of requests admitted from the prefix cache that one step can set. A
# bound of every row (max_num_seqs x width) would cost megabytes per ring entry at long contexts;
# past this many, the next cached requests are admitted in the following steps.
CACHED_ROWS_PER_STEP = 16


def max_new_blocks_per_step(
    max_num_seqs: int, max_num_batched_tokens: int, block_size: int, max_blocks_per_seq: int = 0
) -> int:
    """Block-table entries one step can add.

    Each scheduled request's tokens span at most ``ceil(n / block_size) + 1``
    blocks it did not have, so those are bounded by the token budget divided
    by the block size plus two per request. A request admitted from the prefix
    cache also sets its cached blocks: room for ``CACHED_ROWS_PER_STEP`` rows of
    ``max_blocks_per_seq`` (0: no room; such requests are then admitted one
    per step as far as they fit the bound above).
    """
    cached = min(max_num_seqs, CACHED_ROWS_PER_STEP) * max_blocks_per_seq
    return max_num_batched_tokens // block_size + 2 * max_num_seqs + cached


def descriptor_dims(
    max_num_seqs: int, max_num_batched_tokens: int, block_size: int, mask_words: int = 0, max_blocks_per_seq: int = 0
) -> dict[str, int]:
    """The capacities a descriptor layout takes; ``mask_words`` per token bitmask (0: no structured output)."""
    b = max_new_blocks_per_step(max_num_seqs, max_num_batched_tokens, block_size, max_blocks_per_seq)
    return dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_new_blocks=b,
        mask_words=mask_words,
    )


class StepDescriptor(DESCRIPTOR.view_base):
    """Typed views of one StepDescriptor ring entry (fields: ``DESCRIPTOR``)."""

    __slots__ = ()

    @staticmethod
    def layout(
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_size: int,
        mask_words: int = 0,
        max_blocks_per_seq: int = 0,
    ) -> Layout:
        """The entry layout for these limits (``descriptor_dims``)."""
        dims = descriptor_dims(max_num_seqs, max_num_batched_tokens, block_size, mask_words, max_blocks_per_seq)
        return DESCRIPTOR.layout(dims)


# The worker's host copy of one StepDescriptor (``Record.read``): ``step_id`` and the other header
# values; per request row ``[R]``, the rows' fields with ``sample_rows`` and ``new_rows`` for the flags;
# per new row ``[K]`` (``new_rows``), the sampling and new-row fields; ``token_ids [T]``; ``nb_* [B]``;
# ``mask_row [M]`` and ``bitmask [M, W]`` (int32 words). Other integers are int64.
StepInputs = DESCRIPTOR.host_type


def read_descriptor(desc: StepDescriptor) -> HostCopy:
    """Copy what the worker needs out of a descriptor entry (the entry may be reused after)."""
    return DESCRIPTOR.read(desc)


PACKED_HEADER_NBYTES = 8 * len(DESCRIPTOR.header)


def packed_descriptor_nbytes(header: np.ndarray) -> int:
    """Bytes ``pack_descriptor`` writes for a descriptor with this ``header``."""
    return DESCRIPTOR.packed_nbytes(header)


def pack_descriptor(desc: StepDescriptor, out: np.ndarray) -> int:
    """Copy the live entries of ``desc`` into ``out`` (uint8), back to back; returns the bytes written.

    The header comes first, so a reader holding the first
    ``PACKED_HEADER_NBYTES`` bytes knows the total. A step of R rows, T
    tokens, B new block-table entries and M bitmasks of W words takes ``56 +
    2626 R + 4 T + 12 B + 4 M (W + 1)`` bytes (2,528 of a row's bytes are its
    bias and stop-id room), where the entry has the fixed size of the
    configured maxima: this is what rank 0 relays to ranks on other nodes
    (docs/design.md, "Parallelism"). ``out`` holds at least the layout's ``nbytes``.
    """
    return DESCRIPTOR.pack(desc, out)


def unpack_descriptor(buf: np.ndarray, desc: StepDescriptor) -> None:
    """Write what ``pack_descriptor`` packed into ``buf`` (uint8) back into ``desc``'s fields."""
    DESCRIPTOR.unpack(buf, desc)


@dataclass
class TokenLogprobs:
    """Log-probabilities of ``N`` chosen tokens (raw model log-softmax).

    ``logprob[i]`` is token ``i``'s own; ``top_ids[i, :k]`` and
    ``top_logprobs[i, :k]`` its ``k`` most likely alternatives in descending
    order (``k`` as the request asked; columns past it are unspecified).
    ``index`` says whose tokens they are: output rows for sampled tokens,
    request numbers for prompt tokens.
    """

    index: np.ndarray  # [N] int64
    logprob: np.ndarray  # [N] float32
    top_ids: np.ndarray  # [N, MAX_LOGPROBS] int32
    top_logprobs: np.ndarray  # [N, MAX_LOGPROBS] float32
    pos: np.ndarray | None = None  # [N] int64 position of each prompt token (prompt entries only)


@dataclass
class DecodedOutput:
    """One StepOutput copied out of its ring entry: row ``r`` gave ``token_ids[r]`` to ``req_nums[r]``.

    A request whose row verified drafts has one output row per token it got,
    consecutive and in order. ``draft_matched`` (``[rows]`` uint8, when asked
    for): the proposer found drafts for the request's next step.
    ``logprobs`` (rows whose request asked, ``index`` = row) and
    ``prompt_logprobs`` (``index`` = request number, with positions) are None
    when the step has none or the reader did not ask for them. ``time_ns``
    and ``continues`` are the header's.
    """

    step_id: int
    req_nums: list[int]
    token_ids: list[int]
    time_ns: int = 0
    continues: bool = False
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    draft_matched: np.ndarray | None = None


_OUT = OUTPUT.header_index


class StepOutput(OUTPUT.view_base):
    """Typed views of one StepOutput ring entry (fields: ``OUTPUT``), with its writer and reader."""

    __slots__ = ()

    @staticmethod
    def layout(max_output_rows: int, max_num_batched_tokens: int) -> Layout:
        """The entry layout for ``max_output_rows`` rows (``max_num_seqs`` times the most tokens a row gets:
        ``1 + num_speculative_tokens``) and a step of ``max_num_batched_tokens``."""
        return OUTPUT.layout(dict(max_output_rows=max_output_rows, max_num_batched_tokens=max_num_batched_tokens))

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
    ) -> None:
        """Fill the entry with step ``step_id``'s ``[S]`` request numbers and sampled token ids.

        ``logprobs.index`` are output rows; ``prompt_logprobs.index`` request
        numbers, with ``pos`` set; the rest are the header fields and the
        worker's counts (left as they are if None), and ``draft_matched`` ``[S]`` (None: 0).
        """
        n = len(req_nums)
        h = self.header
        h[_OUT["step_id"]], h[_OUT["num_rows"]] = step_id, n
        h[_OUT["time_ns"]], h[_OUT["continues"]] = time_ns, continues
        if worker_stats is not None:
            self.worker_stats[:] = worker_stats
        self.req_num[:n] = req_nums
        self.token_id[:n] = token_ids
        self.draft_matched[:n] = 0 if draft_matched is None else draft_matched
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

    def read(self, logprobs: bool = False, drafts: bool = False) -> DecodedOutput:
        """Copy the entry out (it may be released right after); log-probabilities and ``draft_matched``
        only if asked."""
        h = self.header
        n = int(h[_OUT["num_rows"]])
        out = DecodedOutput(
            int(h[_OUT["step_id"]]),
            self.req_num[:n].tolist(),
            self.token_id[:n].tolist(),
            int(h[_OUT["time_ns"]]),
            bool(h[_OUT["continues"]]),
        )
        if drafts:
            out.draft_matched = self.draft_matched[:n].copy()
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


def reference_markdown() -> str:
    """docs/step-protocol.md: both records' tables."""
    intro = (
        "# Step protocol reference\n\n"
        "Generated from the field tables in `pipeline/common/step_protocol.py` "
        "(`python -m pipeline.common.step_protocol > docs/step-protocol.md`); "
        'docs/design.md, "The step protocol", explains them.\n'
    )
    return "\n".join([intro, DESCRIPTOR.reference(), OUTPUT.reference()])


if __name__ == "__main__":
    print(reference_markdown(), end="")
