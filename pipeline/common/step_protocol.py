"""The step protocol: what travels on the two shared-memory rings, and how.

Two messages cross process boundaries once per step (docs/design.md, "The
step protocol"):

* :class:`StepDescriptor` (scheduler -> worker): what to compute in step N.
  The scheduler fills it with a :class:`DescriptorBuilder`; the worker copies
  it out with :func:`read_descriptor` before releasing the ring entry.
* :class:`StepOutput` (worker -> scheduler and io_proc): the tokens sampled
  in step N. The worker fills it with :meth:`StepOutput.write`; both readers
  decode it with :meth:`StepOutput.read`.

Each class is a set of typed numpy views over one ring entry, laid out by
:class:`~pipeline.common.layouts.Layout`; arrays are sized by the configured
maxima and the header says how many entries are live. This module is the
only place that knows the field names, so a misspelt field fails at import
or in a type checker, not in another process at run time. That is also why
it is longer than most modules: both messages, their writers and their
readers belong together.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.common.layouts import Layout
from pipeline.common.messages import SamplingParams
from pipeline.common.step_clock import WORKER_STATS_LEN

# Token id meaning "the token this request sampled in the previous step"; the
# worker resolves it from its on-device token-id cache (docs/design.md,
# "The step protocol").
PLACEHOLDER_TOKEN_ID = -1

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
# Alternatives returned per token with log-probabilities (OpenAI's top_logprobs
# limit); the output entry has room for this many per token.
MAX_LOGPROBS = 20
# Room per request in the descriptor for logit_bias entries and for the stop
# token ids that min_tokens masks: parameters travel once, in fixed-size
# fields, so the variable-size ones are bounded (io_proc refuses more with a
# 400). Per descriptor entry at 256 rows they cost 0.6 MiB and 32 KiB.
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 32
# Rows per step that carry a token bitmask (structured output): each takes
# ceil(V / 32) int32 words, 6 KiB at 49,152 tokens and 16 KiB at 128,256, so
# the count is bounded; a constrained row beyond it waits a step
# (docs/design.md, "Structured output").
MAX_MASKED_ROWS = 32
# Bits per bitmask word: the packed layout of llguidance and xgrammar (token
# ``t`` is allowed when bit ``t % 32`` of word ``t // 32`` is set).
MASK_BITS = 32
# Reader indices. On the descriptor ring, worker rank r reads as reader r
# (rank 0 alone without tensor parallelism). On the output ring, which only
# rank 0 writes, the scheduler and io_proc.
OUTPUT_READER_SCHEDULER, OUTPUT_READER_IO = 0, 1


def max_new_blocks_per_step(max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> int:
    """Worst-case number of block-table entries one step can add.

    Each scheduled request's tokens span at most ``ceil(n / block_size) + 1``
    blocks it did not have, so the sum is bounded by the token budget divided
    by the block size plus two per request.
    """
    return max_num_batched_tokens // block_size + 2 * max_num_seqs


class StepDescriptor:
    """Typed views of one StepDescriptor ring entry.

    Header (int64): ``step_id``, ``num_reqs`` (R), ``num_tokens`` (T),
    ``num_new_blocks`` (B), ``num_masks`` (M), ``mask_words`` (W, the
    words of one token bitmask: ``ceil(vocab / 32)``, 0 without a model),
    ``continues`` (1 when a row belongs to a request that was running
    before this step: the device had work waiting, so the gap before the
    step is the host's; docs/design.md, "Metrics"). Per request ``i < R`` (arrays of length
    ``max_num_seqs``): ``req_num`` (int64, unique for the server's life),
    ``req_index`` (int32), ``num_scheduled_tokens`` (int32), ``start_pos`` (int32,
    position of its first scheduled token), ``do_sample`` (uint8: the last
    scheduled token's logits are sampled), ``is_new`` (uint8: the request's
    first step at this req_index; only then are its sampling parameters
    ``temperature`` f32, ``top_p`` f32, ``top_k`` i32, ``seed`` i64 and its
    log-probability counts ``logprobs`` i32 and ``prompt_logprobs`` i32
    valid, -1 meaning none, and so are its penalties and biases:
    ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``,
    ``min_p`` f32, ``min_tokens`` i32, ``prompt_len`` i32 (positions from it
    on hold output tokens), ``num_logit_bias`` i32 with ``logit_bias_ids``
    i32 and ``logit_bias_values`` f32, ``MAX_LOGIT_BIAS`` per row, and
    ``num_stop_ids`` i32 with ``stop_ids`` i32, ``MAX_STOP_TOKEN_IDS`` per
    row, the ids ``min_tokens`` masks), ``num_prompt_logprobs`` (int32: how many of the
    row's positions, from its first, predict a prompt token whose
    log-probability is wanted: position ``j`` predicts the token at ``j+1``)
    and ``next_prompt_token`` (int32: the prompt token after the row's last
    scheduled one when that one is among them, else -1).
    Per token ``t < T``: ``token_ids`` (int32, a real id or
    :data:`PLACEHOLDER_TOKEN_ID`), request-major. Per new block-table entry
    ``b < B``: ``block_table[nb_req_index[b], nb_index[b]] = nb_block[b]`` (int32).
    """

    __slots__ = (
        "header",
        "req_num",
        "req_index",
        "num_scheduled_tokens",
        "start_pos",
        "do_sample",
        "is_new",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "logprobs",
        "prompt_logprobs",
        "num_prompt_logprobs",
        "next_prompt_token",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "min_tokens",
        "prompt_len",
        "num_logit_bias",
        "logit_bias_ids",
        "logit_bias_values",
        "num_stop_ids",
        "stop_ids",
        "token_ids",
        "nb_req_index",
        "nb_index",
        "nb_block",
        "mask_row",
        "bitmask",
    )
    header: np.ndarray
    req_num: np.ndarray
    req_index: np.ndarray
    num_scheduled_tokens: np.ndarray
    start_pos: np.ndarray
    do_sample: np.ndarray
    is_new: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    seed: np.ndarray
    logprobs: np.ndarray
    prompt_logprobs: np.ndarray
    num_prompt_logprobs: np.ndarray
    next_prompt_token: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    repetition_penalty: np.ndarray
    min_p: np.ndarray
    min_tokens: np.ndarray
    prompt_len: np.ndarray
    num_logit_bias: np.ndarray
    logit_bias_ids: np.ndarray
    logit_bias_values: np.ndarray
    num_stop_ids: np.ndarray
    stop_ids: np.ndarray
    token_ids: np.ndarray
    nb_req_index: np.ndarray
    nb_index: np.ndarray
    nb_block: np.ndarray
    mask_row: np.ndarray
    bitmask: np.ndarray

    _STEP_ID, _NUM_REQS, _NUM_TOKENS, _NUM_NEW_BLOCKS, _NUM_MASKS, _MASK_WORDS, _CONTINUES = range(7)
    HEADER_LEN = 7

    @classmethod
    def layout(cls, max_num_seqs: int, max_num_batched_tokens: int, block_size: int, mask_words: int = 0) -> Layout:
        """The entry layout for these limits; ``mask_words`` per token bitmask (0: no structured output)."""
        s, t = max_num_seqs, max_num_batched_tokens
        b = max_new_blocks_per_step(max_num_seqs, max_num_batched_tokens, block_size)
        return Layout.of(
            [
                ("header", np.int64, cls.HEADER_LEN),
                ("req_num", np.int64, s),
                ("req_index", np.int32, s),
                ("num_scheduled_tokens", np.int32, s),
                ("start_pos", np.int32, s),
                ("do_sample", np.uint8, s),
                ("is_new", np.uint8, s),
                ("temperature", np.float32, s),
                ("top_p", np.float32, s),
                ("top_k", np.int32, s),
                ("seed", np.int64, s),
                ("logprobs", np.int32, s),
                ("prompt_logprobs", np.int32, s),
                ("num_prompt_logprobs", np.int32, s),
                ("next_prompt_token", np.int32, s),
                ("presence_penalty", np.float32, s),
                ("frequency_penalty", np.float32, s),
                ("repetition_penalty", np.float32, s),
                ("min_p", np.float32, s),
                ("min_tokens", np.int32, s),
                ("prompt_len", np.int32, s),
                ("num_logit_bias", np.int32, s),
                ("logit_bias_ids", np.int32, s * MAX_LOGIT_BIAS),
                ("logit_bias_values", np.float32, s * MAX_LOGIT_BIAS),
                ("num_stop_ids", np.int32, s),
                ("stop_ids", np.int32, s * MAX_STOP_TOKEN_IDS),
                ("token_ids", np.int32, t),
                ("nb_req_index", np.int32, b),
                ("nb_index", np.int32, b),
                ("nb_block", np.int32, b),
                ("mask_row", np.int32, MAX_MASKED_ROWS),
                ("bitmask", np.int32, max(1, MAX_MASKED_ROWS * mask_words)),
            ]
        )

    def __init__(self, views: dict[str, np.ndarray]):
        for name in self.__slots__:
            setattr(self, name, views[name])
        words = self.bitmask.size // MAX_MASKED_ROWS
        self.bitmask = self.bitmask[: MAX_MASKED_ROWS * words].reshape(MAX_MASKED_ROWS, words)
        self.logit_bias_ids = self.logit_bias_ids.reshape(-1, MAX_LOGIT_BIAS)
        self.logit_bias_values = self.logit_bias_values.reshape(-1, MAX_LOGIT_BIAS)
        self.stop_ids = self.stop_ids.reshape(-1, MAX_STOP_TOKEN_IDS)

    @property
    def step_id(self) -> int:
        return int(self.header[self._STEP_ID])

    @property
    def num_reqs(self) -> int:
        return int(self.header[self._NUM_REQS])

    @property
    def num_tokens(self) -> int:
        return int(self.header[self._NUM_TOKENS])

    @property
    def num_new_blocks(self) -> int:
        return int(self.header[self._NUM_NEW_BLOCKS])

    @property
    def num_masks(self) -> int:
        return int(self.header[self._NUM_MASKS])


class DescriptorBuilder:
    """Collects one step's rows on the scheduler side, then writes them into an entry.

    Rows are added in descriptor order; :meth:`write` fills a
    :class:`StepDescriptor` and :meth:`clear` readies the builder for the next
    step (one builder is reused, so planning allocates no per-step objects
    beyond the row lists).
    """

    def __init__(self) -> None:
        self._req_num: list[int] = []
        self._req_index: list[int] = []
        self._num_tokens: list[int] = []
        self._start_pos: list[int] = []
        self._do_sample: list[bool] = []
        self._is_new: list[bool] = []
        self._num_prompt_logprobs: list[int] = []
        self._next_prompt_token: list[int] = []
        self._sampling: list[tuple[int, SamplingParams, int]] = []
        self._token_ids: list[int] = []
        self._new_blocks: list[tuple[int, int, int]] = []
        self._new_block_arrays: list[np.ndarray] = []  # [3, k] int: req_index, index, block (from add_blocks)
        self._num_array_blocks = 0
        self._masks: list[tuple[int, np.ndarray]] = []

    def __len__(self) -> int:
        """Rows added since the last :meth:`clear`."""
        return len(self._req_num)

    @property
    def num_blocks(self) -> int:
        """Block-table entries added since the last :meth:`clear`."""
        return len(self._new_blocks) + self._num_array_blocks

    @property
    def num_masks(self) -> int:
        """Rows with a token bitmask added since the last :meth:`clear` (at most :data:`MAX_MASKED_ROWS`)."""
        return len(self._masks)

    def clear(self) -> None:
        for lst in (
            self._req_num,
            self._req_index,
            self._num_tokens,
            self._start_pos,
            self._do_sample,
            self._is_new,
            self._num_prompt_logprobs,
            self._next_prompt_token,
            self._sampling,
            self._token_ids,
            self._new_blocks,
            self._new_block_arrays,
            self._masks,
        ):
            lst.clear()
        self._num_array_blocks = 0

    def add_row(
        self,
        req_num: int,
        req_index: int,
        start_pos: int,
        token_ids: list[int],
        do_sample: bool,
        new_params: SamplingParams | None,
        num_prompt_logprobs: int = 0,
        next_prompt_token: int = -1,
        prompt_len: int = 0,
        bitmask: np.ndarray | None = None,
    ) -> None:
        """Schedule ``token_ids`` (positions ``start_pos...``) of request ``req_num`` at row ``req_index``.

        Args:
            token_ids: real ids or :data:`PLACEHOLDER_TOKEN_ID`; at least one.
            do_sample: sample a token from the last scheduled position.
            new_params: the request's sampling parameters on its first step
                at ``req_index`` (the worker keeps them per req_index), else None.
            num_prompt_logprobs: how many of the row's positions, from the
                first, predict a prompt token whose log-probability is wanted.
            next_prompt_token: the prompt token after the row's last position
                when that position is among them, else -1.
            prompt_len: with ``new_params``, the request's prompt length:
                the worker counts tokens at positions from it on as output
                (penalties), the others as prompt (repetition penalty).
            bitmask: with ``do_sample``, int32 ``[W]``: the tokens the
                sampled one may be (structured output); the caller keeps
                :attr:`num_masks` below :data:`MAX_MASKED_ROWS`.
        """
        if bitmask is not None:
            self._masks.append((len(self._req_num), bitmask))
        if new_params is not None:
            self._sampling.append((len(self._req_num), new_params, prompt_len))
        self._req_num.append(req_num)
        self._req_index.append(req_index)
        self._num_tokens.append(len(token_ids))
        self._start_pos.append(start_pos)
        self._do_sample.append(do_sample)
        self._is_new.append(new_params is not None)
        self._num_prompt_logprobs.append(num_prompt_logprobs)
        self._next_prompt_token.append(next_prompt_token)
        self._token_ids.extend(token_ids)

    def add_block(self, req_index: int, index: int, block_id: int) -> None:
        """Set ``block_table[req_index, index] = block_id`` before the step runs."""
        self._new_blocks.append((req_index, index, block_id))

    def add_blocks(self, req_indices: np.ndarray, indices: np.ndarray, block_ids: np.ndarray) -> None:
        """Set ``block_table[req_indices[j], indices[j]] = block_ids[j]`` for every ``j`` (int arrays ``[k]``)."""
        self._new_block_arrays.append(np.stack([req_indices, indices, block_ids]))
        self._num_array_blocks += len(block_ids)

    def write(
        self,
        desc: StepDescriptor,
        step_id: int,
        decode: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
        continues: bool = False,
    ) -> None:
        """Write the collected rows into ``desc`` as step ``step_id``.

        Args:
            decode: ``(req_num, req_index, start_pos, token_ids)``, int arrays
                ``[D]``: D rows of one token each, which sample and are not
                new at their req_index (the scheduler's vectorized decode rows),
                written first; the rows added with :meth:`add_row` follow.
            continues: the header's ``continues`` flag.
        """
        d = 0 if decode is None else len(decode[0])
        n, t, b = d + len(self._req_num), d + len(self._token_ids), self.num_blocks
        h = desc.header
        h[StepDescriptor._STEP_ID], h[StepDescriptor._NUM_REQS] = step_id, n
        h[StepDescriptor._NUM_TOKENS], h[StepDescriptor._NUM_NEW_BLOCKS] = t, b
        h[StepDescriptor._NUM_MASKS], h[StepDescriptor._MASK_WORDS] = len(self._masks), desc.bitmask.shape[1]
        h[StepDescriptor._CONTINUES] = continues
        for m, (row, mask) in enumerate(self._masks):
            desc.mask_row[m], desc.bitmask[m] = d + row, mask
        if d:
            desc.req_num[:d], desc.req_index[:d], desc.start_pos[:d], desc.token_ids[:d] = decode
            desc.num_scheduled_tokens[:d] = 1
            desc.do_sample[:d] = 1
            desc.is_new[:d] = 0
            desc.num_prompt_logprobs[:d] = 0
            desc.next_prompt_token[:d] = -1
        desc.req_num[d:n] = self._req_num
        desc.req_index[d:n] = self._req_index
        desc.num_scheduled_tokens[d:n] = self._num_tokens
        desc.start_pos[d:n] = self._start_pos
        desc.do_sample[d:n] = self._do_sample
        desc.is_new[d:n] = self._is_new
        desc.num_prompt_logprobs[d:n] = self._num_prompt_logprobs
        desc.next_prompt_token[d:n] = self._next_prompt_token
        for i, p, prompt_len in self._sampling:
            i += d
            desc.temperature[i], desc.top_p[i], desc.top_k[i], desc.seed[i] = p.temperature, p.top_p, p.top_k, p.seed
            desc.logprobs[i], desc.prompt_logprobs[i] = p.logprobs, p.prompt_logprobs
            desc.presence_penalty[i], desc.frequency_penalty[i] = p.presence_penalty, p.frequency_penalty
            desc.repetition_penalty[i], desc.min_p[i] = p.repetition_penalty, p.min_p
            desc.min_tokens[i], desc.prompt_len[i] = p.min_tokens, prompt_len
            nb = desc.num_logit_bias[i] = len(p.logit_bias)
            if nb:
                ids, values = zip(*p.logit_bias)
                desc.logit_bias_ids[i, :nb], desc.logit_bias_values[i, :nb] = ids, values
            # Only min_tokens needs the stop ids on the worker, and only if they stop the request.
            stop = p.stop_token_ids if p.min_tokens > 0 and not p.ignore_eos else ()
            desc.num_stop_ids[i] = len(stop)
            desc.stop_ids[i, : len(stop)] = stop
        desc.token_ids[d:t] = self._token_ids
        if b:
            parts = self._new_block_arrays + ([np.asarray(self._new_blocks).T] if self._new_blocks else [])
            desc.nb_req_index[:b], desc.nb_index[:b], desc.nb_block[:b] = np.concatenate(parts, axis=1)


@dataclass
class StepInputs:
    """The worker's host copy of one StepDescriptor, taken before its ring entry is released.

    Arrays are numpy int64 unless noted; ``R`` rows (requests), ``T`` tokens,
    ``S`` sampled rows, ``K`` rows new at their req_index, ``B`` new block-table entries.
    """

    step_id: int
    continues: bool  # the header's flag: a row's request was running before this step
    req_num: np.ndarray  # [R]
    req_index: np.ndarray  # [R]
    query_lens: np.ndarray  # [R] tokens scheduled per row
    start_pos: np.ndarray  # [R] position of each row's first scheduled token
    sample_rows: np.ndarray  # [S] rows whose last token is sampled
    new_rows: np.ndarray  # [K] rows new at their req_index (a request starts or resumes there)
    temperature: np.ndarray  # [K] float32 (for new_rows)
    top_p: np.ndarray  # [K] float32
    top_k: np.ndarray  # [K] int32
    seed: np.ndarray  # [K]
    logprobs: np.ndarray  # [K] int32, alternatives per sampled token, -1 for none
    prompt_logprobs: np.ndarray  # [K] int32, alternatives per prompt token, -1 for none
    presence_penalty: np.ndarray  # [K] float32
    frequency_penalty: np.ndarray  # [K] float32
    repetition_penalty: np.ndarray  # [K] float32
    min_p: np.ndarray  # [K] float32
    min_tokens: np.ndarray  # [K]
    prompt_len: np.ndarray  # [K]
    num_logit_bias: np.ndarray  # [K]
    logit_bias_ids: np.ndarray  # [K, MAX_LOGIT_BIAS], entries past num_logit_bias unspecified
    logit_bias_values: np.ndarray  # [K, MAX_LOGIT_BIAS] float32
    stop_ids: list[np.ndarray]  # K arrays: the ids min_tokens masks
    num_prompt_logprobs: np.ndarray  # [R] positions from the row's first that predict a wanted prompt token
    next_prompt_token: np.ndarray  # [R] prompt token after each row's chunk when wanted, else -1
    token_ids: np.ndarray  # [T], PLACEHOLDER_TOKEN_ID where unresolved
    new_blocks: np.ndarray  # [3, B]: req_index, column in its block-table row, block id
    mask_rows: np.ndarray  # [M] rows (all sampled) whose sampled token is constrained by a bitmask
    bitmask: np.ndarray  # [M, W] int32: bit t % 32 of word t // 32 set = token t allowed


def read_descriptor(desc: StepDescriptor) -> StepInputs:
    """Copy what the worker needs out of a descriptor entry (the entry may be reused after)."""
    r, t, b = desc.num_reqs, desc.num_tokens, desc.num_new_blocks
    new_rows = np.flatnonzero(desc.is_new[:r])
    return StepInputs(
        step_id=desc.step_id,
        continues=bool(desc.header[StepDescriptor._CONTINUES]),
        req_num=desc.req_num[:r].copy(),
        req_index=desc.req_index[:r].astype(np.int64),
        query_lens=desc.num_scheduled_tokens[:r].astype(np.int64),
        start_pos=desc.start_pos[:r].astype(np.int64),
        sample_rows=np.flatnonzero(desc.do_sample[:r]),
        new_rows=new_rows,
        temperature=desc.temperature[new_rows],
        top_p=desc.top_p[new_rows],
        top_k=desc.top_k[new_rows],
        seed=desc.seed[new_rows],
        logprobs=desc.logprobs[new_rows],
        prompt_logprobs=desc.prompt_logprobs[new_rows],
        presence_penalty=desc.presence_penalty[new_rows],
        frequency_penalty=desc.frequency_penalty[new_rows],
        repetition_penalty=desc.repetition_penalty[new_rows],
        min_p=desc.min_p[new_rows],
        min_tokens=desc.min_tokens[new_rows].astype(np.int64),
        prompt_len=desc.prompt_len[new_rows].astype(np.int64),
        num_logit_bias=desc.num_logit_bias[new_rows].astype(np.int64),
        logit_bias_ids=desc.logit_bias_ids[new_rows].astype(np.int64),
        logit_bias_values=desc.logit_bias_values[new_rows],
        stop_ids=[desc.stop_ids[i, : desc.num_stop_ids[i]].astype(np.int64) for i in new_rows],
        num_prompt_logprobs=desc.num_prompt_logprobs[:r].astype(np.int64),
        next_prompt_token=desc.next_prompt_token[:r].astype(np.int64),
        token_ids=desc.token_ids[:t].astype(np.int64),
        new_blocks=np.stack([desc.nb_req_index[:b], desc.nb_index[:b], desc.nb_block[:b]]).astype(np.int64),
        mask_rows=desc.mask_row[: desc.num_masks].astype(np.int64),
        bitmask=desc.bitmask[: desc.num_masks].copy(),
    )


def _live_counts(header: np.ndarray) -> list[tuple[str, int]]:
    """Each StepDescriptor field's name and live length under ``header``, in layout order."""
    r = int(header[StepDescriptor._NUM_REQS])
    t = int(header[StepDescriptor._NUM_TOKENS])
    b = int(header[StepDescriptor._NUM_NEW_BLOCKS])
    m = int(header[StepDescriptor._NUM_MASKS])
    counts = {
        "header": StepDescriptor.HEADER_LEN,
        "token_ids": t,
        "nb_req_index": b,
        "nb_index": b,
        "nb_block": b,
        "mask_row": m,
        "bitmask": m * int(header[StepDescriptor._MASK_WORDS]),
        # Two-dimensional fields count elements: their rows are whole.
        "logit_bias_ids": r * MAX_LOGIT_BIAS,
        "logit_bias_values": r * MAX_LOGIT_BIAS,
        "stop_ids": r * MAX_STOP_TOKEN_IDS,
    }
    return [(name, counts.get(name, r)) for name in StepDescriptor.__slots__]


_ITEMSIZE = {name: dtype.itemsize for name, dtype, _ in StepDescriptor.layout(1, 1, 1).fields}
PACKED_HEADER_NBYTES = StepDescriptor.HEADER_LEN * _ITEMSIZE["header"]


def packed_descriptor_nbytes(header: np.ndarray) -> int:
    """Bytes :func:`pack_descriptor` writes for a descriptor with this ``header`` (int64 ``[6]``)."""
    return sum(_ITEMSIZE[name] * n for name, n in _live_counts(header))


def pack_descriptor(desc: StepDescriptor, out: np.ndarray) -> int:
    """Copy the live entries of ``desc`` into ``out`` (uint8), back to back; returns the bytes written.

    The header comes first, so a reader holding the first
    :data:`PACKED_HEADER_NBYTES` bytes knows the total
    (:func:`packed_descriptor_nbytes`). A step of R rows, T tokens, B new
    block-table entries and M bitmasks of W words takes ``48 + 2618 R + 4 T
    + 12 B + 4 M (W + 1)`` bytes (2,528 of a row's bytes are its bias and
    stop-id room), where the
    entry has the fixed size of the configured maxima: this is what rank 0
    relays to ranks on other nodes (docs/design.md, "Parallelism"). ``out``
    must hold at least the entry layout's ``nbytes``.
    """
    off = 0
    for name, n in _live_counts(desc.header):
        raw = getattr(desc, name).reshape(-1)[:n].view(np.uint8)
        out[off : off + raw.size] = raw
        off += raw.size
    return off


def unpack_descriptor(buf: np.ndarray, desc: StepDescriptor) -> None:
    """Write what :func:`pack_descriptor` packed into ``buf`` (uint8) back into ``desc``'s fields."""
    off = 0
    for name, n in _live_counts(buf[:PACKED_HEADER_NBYTES].view(np.int64)):
        view = getattr(desc, name).reshape(-1)
        size = view.itemsize * n
        view[:n] = buf[off : off + size].view(view.dtype)
        off += size


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


class StepOutput:
    """Typed views of one StepOutput ring entry.

    Header (int64): ``step_id``, ``num_rows`` (S), ``num_logprob_rows`` (L),
    ``num_prompt_entries`` (P), ``time_ns`` (the step's device end on
    ``time.monotonic_ns()``'s clock: the engine's timestamp of every token
    in it, vLLM's ``NEW_TOKENS`` event), ``continues`` (the descriptor's
    flag). ``worker_stats`` (int64 ``[WORKER_STATS_LEN]``): the worker's
    cumulative :class:`~pipeline.common.step_clock.WorkerClock` counts. Row ``r < S`` (arrays of length
    ``max_num_seqs``): ``req_num`` (int64) and the sampled ``token_id``
    (int32). Only rows whose descriptor row had ``do_sample`` set produce an
    output row, in descriptor order. Rows whose request asked for
    log-probabilities, ``l < L``: ``lp_row`` (int32, the output row),
    ``lp_logprob`` (f32), ``lp_top_ids`` (int32) and ``lp_top_logprobs``
    (f32), ``MAX_LOGPROBS`` per row. Prompt tokens, ``e < P`` (arrays of
    length ``max_num_batched_tokens``): ``pe_req_num`` (int64), ``pe_pos``
    (int32, the prompt token's position), ``pe_logprob``, ``pe_top_ids``,
    ``pe_top_logprobs`` likewise.
    """

    __slots__ = (
        "header",
        "worker_stats",
        "req_num",
        "token_id",
        "lp_row",
        "lp_logprob",
        "lp_top_ids",
        "lp_top_logprobs",
        "pe_req_num",
        "pe_pos",
        "pe_logprob",
        "pe_top_ids",
        "pe_top_logprobs",
    )
    header: np.ndarray
    worker_stats: np.ndarray
    req_num: np.ndarray
    token_id: np.ndarray
    lp_row: np.ndarray
    lp_logprob: np.ndarray
    lp_top_ids: np.ndarray
    lp_top_logprobs: np.ndarray
    pe_req_num: np.ndarray
    pe_pos: np.ndarray
    pe_logprob: np.ndarray
    pe_top_ids: np.ndarray
    pe_top_logprobs: np.ndarray

    _STEP_ID, _NUM_ROWS, _NUM_LOGPROB_ROWS, _NUM_PROMPT_ENTRIES, _TIME_NS, _CONTINUES = range(6)
    HEADER_LEN = 6

    @classmethod
    def layout(cls, max_num_seqs: int, max_num_batched_tokens: int) -> Layout:
        """The entry layout for ``max_num_seqs`` rows and a step of ``max_num_batched_tokens``."""
        s, t, k = max_num_seqs, max_num_batched_tokens, MAX_LOGPROBS
        return Layout.of(
            [
                ("header", np.int64, cls.HEADER_LEN),
                ("worker_stats", np.int64, WORKER_STATS_LEN),
                ("req_num", np.int64, s),
                ("token_id", np.int32, s),
                ("lp_row", np.int32, s),
                ("lp_logprob", np.float32, s),
                ("lp_top_ids", np.int32, s * k),
                ("lp_top_logprobs", np.float32, s * k),
                ("pe_req_num", np.int64, t),
                ("pe_pos", np.int32, t),
                ("pe_logprob", np.float32, t),
                ("pe_top_ids", np.int32, t * k),
                ("pe_top_logprobs", np.float32, t * k),
            ]
        )

    def __init__(self, views: dict[str, np.ndarray]):
        for name in self.__slots__:
            v = views[name]
            setattr(self, name, v.reshape(-1, MAX_LOGPROBS) if name.endswith(("top_ids", "top_logprobs")) else v)

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
    ) -> None:
        """Fill the entry with step ``step_id``'s ``[S]`` request numbers and sampled token ids.

        ``logprobs.index`` are output rows; ``prompt_logprobs.index`` request
        numbers, with ``pos`` set; the rest are the header fields and the
        worker's counts (left as they are if None).
        """
        n = len(req_nums)
        h = self.header
        h[self._STEP_ID], h[self._NUM_ROWS] = step_id, n
        h[self._TIME_NS], h[self._CONTINUES] = time_ns, continues
        if worker_stats is not None:
            self.worker_stats[:] = worker_stats
        self.req_num[:n] = req_nums
        self.token_id[:n] = token_ids
        h[self._NUM_LOGPROB_ROWS] = 0 if logprobs is None else len(logprobs.index)
        if logprobs is not None:
            m = len(logprobs.index)
            self.lp_row[:m] = logprobs.index
            self.lp_logprob[:m] = logprobs.logprob
            self.lp_top_ids[:m] = logprobs.top_ids
            self.lp_top_logprobs[:m] = logprobs.top_logprobs
        h[self._NUM_PROMPT_ENTRIES] = 0 if prompt_logprobs is None else len(prompt_logprobs.index)
        if prompt_logprobs is not None:
            m = len(prompt_logprobs.index)
            self.pe_req_num[:m] = prompt_logprobs.index
            self.pe_pos[:m] = prompt_logprobs.pos
            self.pe_logprob[:m] = prompt_logprobs.logprob
            self.pe_top_ids[:m] = prompt_logprobs.top_ids
            self.pe_top_logprobs[:m] = prompt_logprobs.top_logprobs

    def read(self, logprobs: bool = False) -> DecodedOutput:
        """Copy the entry out (the entry may be released right after); log-probabilities only if asked."""
        h = self.header
        n = int(h[self._NUM_ROWS])
        out = DecodedOutput(
            int(h[self._STEP_ID]),
            self.req_num[:n].tolist(),
            self.token_id[:n].tolist(),
            int(h[self._TIME_NS]),
            bool(h[self._CONTINUES]),
        )
        if logprobs:
            if m := int(h[self._NUM_LOGPROB_ROWS]):
                out.logprobs = TokenLogprobs(
                    self.lp_row[:m].astype(np.int64),
                    self.lp_logprob[:m].copy(),
                    self.lp_top_ids[:m].copy(),
                    self.lp_top_logprobs[:m].copy(),
                )
            if m := int(h[self._NUM_PROMPT_ENTRIES]):
                out.prompt_logprobs = TokenLogprobs(
                    self.pe_req_num[:m].copy(),
                    self.pe_logprob[:m].copy(),
                    self.pe_top_ids[:m].copy(),
                    self.pe_top_logprobs[:m].copy(),
                    self.pe_pos[:m].astype(np.int64),
                )
        return out
