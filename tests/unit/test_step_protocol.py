"""The step-protocol codec: what the scheduler writes is exactly what the worker and io_proc read."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.messages import SamplingParams
from pipeline.common.step_clock import WORKER_STATS_LEN
from pipeline.common.step_output import MAX_LOGPROBS, StepOutput, TokenLogprobs
from pipeline.common.step_protocol import (
    MASK_BITS,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    PLACEHOLDER_TOKEN_ID,
    StepDescriptor,
    TokenMasks,
    max_new_blocks_per_step,
    pack_descriptor,
    packed_descriptor_nbytes,
    read_descriptor,
    unpack_descriptor,
)

MAX_SEQS, MAX_TOKENS, BLOCK = 8, 64, 4


@st.composite
def steps(draw):
    """A random step within the limits: rows with token chunks, sampling params on new rows, new blocks."""
    n = draw(st.integers(1, MAX_SEQS))
    budget = MAX_TOKENS
    rows = []
    for i in range(n):
        k = draw(st.integers(1, max(1, budget - (n - i - 1))))
        budget -= k
        toks = draw(st.lists(st.one_of(st.just(PLACEHOLDER_TOKEN_ID), st.integers(0, 50_000)), min_size=k, max_size=k))
        params = draw(
            st.one_of(
                st.none(),
                st.builds(
                    SamplingParams,
                    max_tokens=st.integers(1, 100),
                    temperature=st.floats(0, 2, width=32),
                    top_p=st.floats(0.0625, 1, width=32),
                    top_k=st.integers(0, 100),
                    seed=st.integers(0, 2**62),
                    logprobs=st.integers(-1, MAX_LOGPROBS),
                    prompt_logprobs=st.integers(-1, MAX_LOGPROBS),
                    presence_penalty=st.floats(-2, 2, width=32),
                    frequency_penalty=st.floats(-2, 2, width=32),
                    repetition_penalty=st.floats(0.125, 4, width=32),
                    min_p=st.floats(0, 1, width=32),
                    min_tokens=st.integers(0, 100),
                    ignore_eos=st.booleans(),
                    stop_token_ids=st.lists(st.integers(0, 50_000), max_size=MAX_STOP_TOKEN_IDS, unique=True).map(
                        tuple
                    ),
                    logit_bias=st.dictionaries(
                        st.integers(0, 50_000), st.floats(-100, 100, width=32), max_size=MAX_LOGIT_BIAS
                    ).map(lambda d: tuple(d.items())),
                ),
            )
        )
        rows.append(
            (
                draw(st.integers(1, 2**40)),
                i,
                draw(st.integers(0, 4096)),
                toks,
                draw(st.booleans()),
                params,
                draw(st.integers(0, k)),
                draw(st.integers(-1, 50_000)),
                draw(st.integers(0, 4096)),
            )
        )
    cap = max_new_blocks_per_step(MAX_SEQS, MAX_TOKENS, BLOCK)
    blocks = draw(
        st.lists(st.tuples(st.integers(0, MAX_SEQS - 1), st.integers(0, 511), st.integers(0, 10_000)), max_size=cap)
    )
    return draw(st.integers(0, 2**40)), rows, blocks


def new_blocks(x) -> list[list[int]]:
    """The step's new block-table entries as ``[req_index, column, block]``."""
    return [list(b) for b in zip(x.nb_req_index.tolist(), x.nb_index.tolist(), x.nb_block.tolist())]


def _entry(layout):
    return layout.views(bytearray(layout.nbytes))


@settings(max_examples=60, deadline=None)
@given(steps())
def test_descriptor_round_trip(step):
    step_id, rows, blocks = step
    desc = StepDescriptor(_entry(StepDescriptor.layout(MAX_SEQS, MAX_TOKENS, BLOCK)))
    # A builder reused across steps must not leak the previous step's rows.
    b = DescriptorBuilder()
    b.add_row(999, 7, 0, [1, 2, 3], True, SamplingParams(max_tokens=1))
    b.add_block(7, 0, 5)
    b.clear()
    for row in rows:
        b.add_row(*row)
    for blk in blocks:
        b.add_block(*blk)
    assert len(b) == len(rows)
    b.write(desc, step_id)

    x = read_descriptor(desc)
    assert x.step_id == step_id
    assert x.req_num.tolist() == [r[0] for r in rows]
    assert x.req_index.tolist() == [r[1] for r in rows]
    assert x.start_pos.tolist() == [r[2] for r in rows]
    assert x.num_scheduled_tokens.tolist() == [len(r[3]) for r in rows]
    assert x.token_ids.tolist() == [t for r in rows for t in r[3]]
    assert x.sample_rows.tolist() == [i for i, r in enumerate(rows) if r[4]]
    new = [i for i, r in enumerate(rows) if r[5] is not None]
    assert x.new_rows.tolist() == new
    params = [rows[i][5] for i in new]
    np.testing.assert_array_equal(x.temperature, np.array([p.temperature for p in params], dtype=np.float32))
    np.testing.assert_array_equal(x.top_p, np.array([p.top_p for p in params], dtype=np.float32))
    assert x.top_k.tolist() == [p.top_k for p in params]
    assert x.seed.tolist() == [p.seed for p in params]
    assert x.logprobs.tolist() == [p.logprobs for p in params]
    assert x.prompt_logprobs.tolist() == [p.prompt_logprobs for p in params]
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        np.testing.assert_array_equal(getattr(x, name), np.array([getattr(p, name) for p in params], np.float32))
    assert x.min_tokens.tolist() == [p.min_tokens for p in params]
    assert x.prompt_len.tolist() == [rows[i][8] for i in new]
    for j, p in enumerate(params):
        nb = len(p.logit_bias)
        assert x.num_logit_bias[j] == nb
        assert x.logit_bias_ids[j, :nb].tolist() == [t for t, _ in p.logit_bias]
        np.testing.assert_array_equal(x.logit_bias_values[j, :nb], np.array([b for _, b in p.logit_bias], np.float32))
        # The worker gets the stop ids only when min_tokens has something to mask.
        masked = p.stop_token_ids if p.min_tokens > 0 and not p.ignore_eos else ()
        assert x.stop_ids[j, : x.num_stop_ids[j]].tolist() == list(masked)
    assert x.num_prompt_logprobs.tolist() == [r[6] for r in rows]
    assert x.next_prompt_token.tolist() == [r[7] for r in rows]
    assert new_blocks(x) == [list(blk) for blk in blocks]


@settings(max_examples=40, deadline=None)
@given(steps(), steps())
def test_packed_descriptor_round_trip(step, previous):
    """What rank 0 relays to other nodes unpacks, over an entry holding an older step, into the same inputs."""
    layout = StepDescriptor.layout(MAX_SEQS, MAX_TOKENS, BLOCK)
    src, dst = StepDescriptor(_entry(layout)), StepDescriptor(_entry(layout))
    for desc, (step_id, rows, blocks) in ((dst, previous), (src, step)):
        b = DescriptorBuilder()
        for row in rows:
            b.add_row(*row)
        for blk in blocks:
            b.add_block(*blk)
        b.write(desc, step_id, continues=bool(step_id % 2))
    buf = np.full(layout.nbytes, 0xAB, dtype=np.uint8)
    n = pack_descriptor(src, buf)
    _, rows, blocks = step
    assert n == packed_descriptor_nbytes(src.header) == 48 + 2634 * len(rows) + 4 * src.num_tokens + 12 * len(blocks)
    unpack_descriptor(buf, dst)
    want, got = read_descriptor(src), read_descriptor(dst)
    for name in type(want).__slots__:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


def test_masked_rows_round_trip():
    """The rows whose masks follow reach the worker's copy, and the relay to other nodes; their masks
    travel in a TokenMasks entry of their own."""
    layout = StepDescriptor.layout(MAX_SEQS, MAX_TOKENS, BLOCK)
    src, dst = StepDescriptor(_entry(layout)), StepDescriptor(_entry(layout))
    b = DescriptorBuilder()
    b.add_row(7, 0, 0, [1, 2], True, None)
    b.add_row(8, 1, 5, [3], True, None, masked=True)
    b.write(src, 4)
    buf = np.zeros(layout.nbytes, dtype=np.uint8)
    assert pack_descriptor(src, buf) == packed_descriptor_nbytes(src.header) == 48 + 2 * 2634 + 12 + 4
    unpack_descriptor(buf, dst)
    for desc in (src, dst):
        x = read_descriptor(desc)
        assert x.mask_row.tolist() == [1] and x.num_masked_rows == 1
    b.clear()
    b.write(src, 5, decode=(np.array([7]), np.array([0]), np.array([2]), np.array([-1])))
    assert read_descriptor(src).mask_row.shape == (0,)
    masks = TokenMasks(_entry(TokenMasks.layout(MAX_SEQS, 3 * MASK_BITS - 5)))
    assert masks.bitmask.shape == (MAX_SEQS, 3)  # a mask on every row, ceil(V / 32) words each


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**40), st.lists(st.tuples(st.integers(1, 2**50), st.integers(0, 2**31 - 1)), max_size=MAX_SEQS))
def test_output_round_trip(step_id, rows):
    out = StepOutput(_entry(StepOutput.layout(MAX_SEQS, MAX_TOKENS)))
    out.write(
        7, np.array([1, 2, 3]), np.array([4, 5, 6]), time_ns=5, continues=True, failed=np.array([2])
    )  # a previous step in the same ring entry
    assert out.read().failed == [2] and out.read().failed_why == [0]
    counts = np.arange(WORKER_STATS_LEN, dtype=np.int64) * step_id
    ids = np.array([r for r, _ in rows], dtype=np.int64)
    failed = np.unique(ids)[::2]  # requests whose logits were not finite, or whose LoRA adapter was unreadable
    why = np.arange(len(failed)) % 2
    tokens = np.array([t for _, t in rows], dtype=np.int64)
    out.write(step_id, ids, tokens, time_ns=step_id + 1, worker_stats=counts, failed=failed, failed_why=why)
    got = out.read()
    assert (got.step_id, got.req_nums, got.token_ids) == (step_id, [r for r, _ in rows], [t for _, t in rows])
    assert got.failed == failed.tolist() and got.failed_why == why.tolist()
    assert (got.time_ns, got.continues) == (step_id + 1, False)
    np.testing.assert_array_equal(out.worker_stats, counts)
    assert got.logprobs is None and got.prompt_logprobs is None
    as_arrays = out.read(arrays=True)  # the scheduler's read
    assert as_arrays.req_nums.dtype == as_arrays.token_ids.dtype == np.int64
    assert (as_arrays.req_nums.tolist(), as_arrays.token_ids.tolist()) == (got.req_nums, got.token_ids)


def _logprobs(rng, n: int, index) -> TokenLogprobs:
    return TokenLogprobs(
        np.asarray(index, dtype=np.int64),
        rng.standard_normal(n).astype(np.float32),
        rng.integers(0, 50_000, (n, MAX_LOGPROBS)).astype(np.int32),
        rng.standard_normal((n, MAX_LOGPROBS)).astype(np.float32),
    )


@settings(max_examples=30, deadline=None)
@given(st.integers(0, MAX_SEQS), st.integers(0, MAX_TOKENS), st.integers(0, 2**32))
def test_output_logprobs_round_trip(num_rows, num_prompt, seed):
    rng = np.random.default_rng(seed)
    out = StepOutput(_entry(StepOutput.layout(MAX_SEQS, MAX_TOKENS)))
    rows = sorted(rng.choice(max(num_rows, 1), size=rng.integers(0, num_rows + 1), replace=False).tolist())
    lp = _logprobs(rng, len(rows), rows)
    plp = _logprobs(rng, num_prompt, rng.integers(1, 99, num_prompt))
    plp.pos = rng.integers(1, 4000, num_prompt)
    out.write(3, np.arange(num_rows), np.arange(num_rows), lp if rows else None, plp if num_prompt else None)
    assert out.read().logprobs is None  # only when asked
    got = out.read(logprobs=True)
    for want, have in ((lp if rows else None, got.logprobs), (plp if num_prompt else None, got.prompt_logprobs)):
        if want is None:
            assert have is None
            continue
        for f in ("index", "logprob", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(have, f), getattr(want, f))
    if num_prompt:
        np.testing.assert_array_equal(got.prompt_logprobs.pos, plp.pos)


def test_decode_rows_come_first():
    """Vectorized decode rows lead the descriptor; added rows, their parameters, masks and blocks follow them."""
    desc = StepDescriptor(_entry(StepDescriptor.layout(MAX_SEQS, MAX_TOKENS, BLOCK)))
    b = DescriptorBuilder()
    b.add_row(
        9,
        4,
        0,
        [5, 6, 7],
        True,
        SamplingParams(max_tokens=3, temperature=0.5),
        prompt_len=3,
        masked=True,
    )
    b.add_block(4, 0, 11)
    b.add_blocks(np.array([1, 2]), np.array([3, 5]), np.array([12, 13]))
    b.write(desc, 3, decode=(np.array([7, 8]), np.array([1, 2]), np.array([48, 80]), np.array([-1, -1])))
    x = read_descriptor(desc)
    assert x.req_num.tolist() == [7, 8, 9] and x.req_index.tolist() == [1, 2, 4]
    assert x.num_scheduled_tokens.tolist() == [1, 1, 3] and x.start_pos.tolist() == [48, 80, 0]
    assert x.token_ids.tolist() == [-1, -1, 5, 6, 7] and x.sample_rows.tolist() == [0, 1, 2]
    assert x.new_rows.tolist() == [2] and x.temperature.tolist() == [0.5] and x.prompt_len.tolist() == [3]
    assert x.mask_row.tolist() == [2]
    assert sorted(new_blocks(x)) == [[1, 3, 12], [2, 5, 13], [4, 0, 11]]


def test_descriptor_copy_outlives_the_ring_entry():
    """The worker releases the ring entry right after reading: its copy must not alias the ring."""
    desc = StepDescriptor(_entry(StepDescriptor.layout(MAX_SEQS, MAX_TOKENS, BLOCK)))
    b = DescriptorBuilder()
    b.add_row(5, 1, 10, [PLACEHOLDER_TOKEN_ID], True, None)
    b.add_block(1, 2, 3)
    b.write(desc, 1)
    x = read_descriptor(desc)
    b.clear()
    b.add_row(6, 2, 0, [9, 9], False, SamplingParams(max_tokens=1))
    b.add_block(2, 0, 4)
    b.write(desc, 2)
    assert (x.step_id, x.req_num.tolist(), x.req_index.tolist(), x.token_ids.tolist()) == (1, [5], [1], [-1])
    assert new_blocks(x) == [[1, 2, 3]]
