"""The step protocol's wire format: what crosses the two rings once per step.

``StepDescriptor`` (scheduler -> worker) says what to compute in step N;
``StepOutput`` (worker -> scheduler and io_proc, ``step_output``) the tokens it
sampled (docs/design.md, "The step protocol"). Each is defined by one field
table, ``DESCRIPTOR`` here; docs/step-protocol.md is generated from them. The
scheduler writes descriptors with ``descriptor_builder.DescriptorBuilder``.
"""

from __future__ import annotations

import numpy as np

from pipeline.common.layouts import Layout
from pipeline.common.records import Field, Group, HostCopy, Record
from pipeline.common.step_output import OUTPUT

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
# Worker rank r reads the ring as reader r (rank 0 alone without tensor parallelism).
DESCRIPTOR_RING_ENTRIES = MAX_INFLIGHT_STEPS + 2
# Parameters travel once, in fixed-size fields, so the variable-size ones are
# bounded (io_proc refuses more with a 400): per descriptor entry at 256 rows
# they cost 0.6 MiB and 32 KiB.
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 32
# Bits per bitmask word: the packed layout of llguidance and xgrammar (token
# ``t`` is allowed when bit ``t % 32`` of word ``t // 32`` is set).
MASK_BITS = 32

i32, i64, f32, u8 = np.int32, np.int64, np.float32, np.uint8

DESCRIPTOR = Record(
    "StepDescriptor",
    header=(
        Field("step_id", i64, "the step's id, counting up from 0"),
        Field("num_reqs", i64, "live request rows (R)"),
        Field("num_tokens", i64, "live tokens (T)"),
        Field("num_new_blocks", i64, "live new block-table entries (B)"),
        Field(
            "num_masked_rows",
            i64,
            "rows that sample under a grammar (M): the step's `TokenMasks` entry follows",
        ),
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
                    "its last scheduled tokens that are drafts to verify, each sampled: DRAFT_TOKEN_ID (the "
                    "proposer's) or named (its grammar's forced tokens)",
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
                Field(
                    "lora_slot", i32, 'the LoRA adapter slot its tokens use, 0 for none (docs/design.md, "Multi-LoRA")'
                ),
                Field(
                    "lora_id", i32, "the adapter that slot holds: the worker loads it there first if it holds another"
                ),
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
            "masked_rows",
            "masked row",
            "max_num_seqs",
            "num_masked_rows",
            (Field("mask_row", i32, "a sampled request row whose token its grammar constrains, in row order"),),
        ),
    ),
    constants={
        "MAX_LOGIT_BIAS": MAX_LOGIT_BIAS,
        "MAX_STOP_TOKEN_IDS": MAX_STOP_TOKEN_IDS,
    },
)

# The masks of a step's constrained rows (scheduler -> worker, on a ring of their own): written once
# each row's previous token is known, which under asynchronous scheduling is after the step was
# published; the worker runs the step's forward pass meanwhile and waits only before sampling
# (docs/design.md, "Structured output").
MASKS = Record(
    "TokenMasks",
    header=(
        Field("step_id", i64, "the step whose `mask_row` rows these constrain"),
        Field("num_masks", i64, "masks: one per sampled position of the step's `mask_row` rows"),
        Field("mask_words", i64, "int32 words of one bitmask, `ceil(vocab / 32)`"),
    ),
    groups=(
        Group(
            "masks",
            "masked sampled position",
            "max_masks",
            "num_masks",
            (
                Field(
                    "bitmask",
                    i32,
                    "per `mask_row` in order, one per sampled position of that row (1, or 1 + its drafts): bit "
                    "t % 32 of word t // 32 set, token t allowed",
                    width="mask_words",
                    widen=False,
                ),
            ),
        ),
    ),
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
    max_num_seqs: int, max_num_batched_tokens: int, block_size: int, max_blocks_per_seq: int = 0
) -> dict[str, int]:
    """The capacities a descriptor layout takes."""
    b = max_new_blocks_per_step(max_num_seqs, max_num_batched_tokens, block_size, max_blocks_per_seq)
    return dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_new_blocks=b)


class StepDescriptor(DESCRIPTOR.view_base):
    """Typed views of one StepDescriptor ring entry (fields: ``DESCRIPTOR``)."""

    __slots__ = ()

    @staticmethod
    def layout(
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_size: int,
        max_blocks_per_seq: int = 0,
    ) -> Layout:
        """The entry layout for these limits (``descriptor_dims``)."""
        dims = descriptor_dims(max_num_seqs, max_num_batched_tokens, block_size, max_blocks_per_seq)
        return DESCRIPTOR.layout(dims)


class TokenMasks(MASKS.view_base):
    """Typed views of one TokenMasks ring entry (fields: ``MASKS``)."""

    __slots__ = ()

    @staticmethod
    def layout(max_masks: int, vocab_size: int) -> Layout:
        """An entry with room for ``max_masks`` masks (a mask on every sampled position: ``max_num_seqs``
        times ``1 + num_speculative_tokens``), ``ceil(vocab_size / 32)`` words each."""
        return MASKS.layout(dict(max_masks=max_masks, mask_words=-(-vocab_size // MASK_BITS)))


# The worker's host copy of one StepDescriptor (``Record.read``): ``step_id`` and the other header
# values; per request row ``[R]``, the rows' fields with ``sample_rows`` and ``new_rows`` for the flags;
# per new row ``[K]`` (``new_rows``), the sampling and new-row fields; ``token_ids [T]``; ``nb_* [B]``;
# ``mask_row [M]``. Other integers are int64.
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
    tokens, B new block-table entries and M masked rows takes ``48 +
    2634 R + 4 T + 12 B + 4 M`` bytes (2,528 of a row's bytes are its
    bias and stop-id room), where the entry has the fixed size of the
    configured maxima: this is what rank 0 relays to ranks on other nodes
    (docs/design.md, "Parallelism"). ``out`` holds at least the layout's ``nbytes``.
    """
    return DESCRIPTOR.pack(desc, out)


def unpack_descriptor(buf: np.ndarray, desc: StepDescriptor) -> None:
    """Write what ``pack_descriptor`` packed into ``buf`` (uint8) back into ``desc``'s fields."""
    DESCRIPTOR.unpack(buf, desc)


def reference_markdown() -> str:
    """docs/step-protocol.md: the records' tables."""
    intro = (
        "# Step protocol reference\n\n"
        "Generated from the field tables in `pipeline/common/step_protocol.py` and "
        "`pipeline/common/step_output.py` "
        "(`python -m pipeline.common.step_protocol > docs/step-protocol.md`); "
        'docs/design.md, "The step protocol", explains them.\n'
    )
    return "\n".join([intro, DESCRIPTOR.reference(), MASKS.reference(), OUTPUT.reference()])


if __name__ == "__main__":
    print(reference_markdown(), end="")
