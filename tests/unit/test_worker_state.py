"""Per-req_index device state and the worker's start-up and per-step input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.common.messages import SamplingParams
from pipeline.gpu_worker.attention import cpu_paged
from pipeline.gpu_worker.attention.kv_layout import HEAD_MAJOR
from pipeline.gpu_worker.device import DeviceOps, UploadBatch
from pipeline.gpu_worker.executor import ModelExecutor
from pipeline.gpu_worker.input_batch import POISON_TOKEN_ID, InputBatch
from pipeline.gpu_worker.model_runner import ModelRunner
from tests.unit.sync_guard import FakeAsyncOps, SyncGuard
from tests.unit.test_no_host_sync import BLOCK, GREEDY, SAMPLED, Steps, engine_config, tiny_model

CPU = torch.device("cpu")


def test_row_parameters_live_on_the_device_and_change_only_for_new_rows():
    config = engine_config()
    state = InputBatch(config.scheduler.max_num_seqs, config.max_blocks_per_seq, DeviceOps(CPU))
    assert state.token_cache.tolist() == [POISON_TOKEN_ID] * config.scheduler.max_num_seqs
    steps = Steps(config)
    hot = SamplingParams(max_tokens=8, temperature=0.5, top_p=0.25, top_k=7, seed=-3)
    state.apply(steps.make([(2, 0, [1, 2, 3, 4, 5], True, hot), (5, 0, [1], True, GREEDY)]))
    assert state.params["temperature"][[2, 5]].tolist() == [0.5, 0.0] and state.params["top_p"][2].item() == 0.25
    assert state.params["top_k"][2].item() == 7 and state.params["seed"][2].item() == -3
    assert state.host_temperature[2] == 0.5 and state.host_top_k[2] == 7 and state.host_top_p[2] == 0.25
    per_row = config.max_blocks_per_seq
    assert state.block_table[2, :2].tolist() == [2 * per_row, 2 * per_row + 1]
    # A later step of the same requests carries no parameters: the rows keep theirs.
    state.apply(steps.make([(2, 5, [9], True, None), (5, 1, [9], True, None)]))
    assert state.params["temperature"][[2, 5]].tolist() == [0.5, 0.0] and state.params["seed"][2].item() == -3
    # A new request in req_index 5 replaces them.
    state.apply(steps.make([(5, 0, [1, 2], True, SAMPLED[1])]))
    assert (
        state.params["temperature"][5].item() == 1.0
        and state.params["seed"][5].item() == 3
        and state.host_temperature[5] == 1.0
    )


def test_max_model_len_beyond_the_rope_table_is_refused_at_start_up():
    model = tiny_model(max_position_embeddings=64)
    with pytest.raises(ValueError, match="max_model_len 128 exceeds the model's max_position_embeddings 64"):
        ModelExecutor(engine_config(max_model_len=128), model, CPU, torch.float32)


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_bucketed"])
def test_warm_up_step_writes_only_the_padding_block(backend):
    """The start-up warm-up step runs the backend's prefill and decode paths over the padding block, which the
    scheduler never hands out: no block a request may own changes."""
    if backend == "cpu_paged" and cpu_paged.unavailable_reason() is not None:
        pytest.skip(f"cpu_paged cannot run here: {cpu_paged.unavailable_reason()}")
    config = engine_config()
    executor = ModelExecutor(config, tiny_model(attention_backend=backend, heads=(4, 2, 64)), CPU, torch.float32)
    assert executor.attn_backend.name == backend
    executor.warm_up(DeviceOps(CPU).upload)
    heads, dim = executor.model.num_kv_heads, executor.model.head_dim
    pad = slice(config.num_kv_blocks * BLOCK, (config.num_kv_blocks + 1) * BLOCK)
    for cache in (c for layer in executor.kv_caches for c in layer):
        slots = (
            cache.view(heads, -1, dim) if executor.attn_backend.cache_layout == HEAD_MAJOR else cache.transpose(0, 1)
        )
        written = slots.abs().sum(dim=(0, 2)) > 0
        assert written[pad][:2].all() and not written[pad][2:].any()  # positions 0 and 1 of the two rows
        assert not written[: pad.start].any()


def test_token_ids_outside_the_vocabulary_are_refused_before_the_device_sees_them():
    config = engine_config()
    runner = ModelRunner(config, ModelExecutor(config, tiny_model(), CPU, torch.float32), CPU)
    steps = Steps(config)
    with pytest.raises(ValueError, match="token id 512 is outside the vocabulary of 512"):
        runner.launch(steps.make([(0, 0, [1, 512], True, GREEDY)]), 0)
    assert np.all(runner.input_batch.host_temperature == 0)  # nothing was applied


def test_feature_flags_follow_the_rows_parameters():
    """A step skips sampling, log-probability and penalty planning only while no req_index asks for them."""
    config = engine_config()
    state = InputBatch(config.scheduler.max_num_seqs, config.max_blocks_per_seq, DeviceOps(CPU), vocab_size=512)
    steps = Steps(config)
    flags = lambda: (state.any_hot, state.any_logprobs, state.any_penalized, state.any_penalty_work)  # noqa: E731
    state.apply(steps.make([(0, 0, [1, 2], True, GREEDY), (1, 0, [3], True, GREEDY)]))
    assert flags() == (False, False, False, False)
    special = SamplingParams(max_tokens=8, temperature=0.7, seed=1, logprobs=2, repetition_penalty=1.2)
    state.apply(steps.make([(1, 0, [3], True, special)]))
    assert flags() == (True, True, True, True)
    assert state.penalty.repetition[1].item() == pytest.approx(1.2)
    assert state.params["temperature"][1].item() == pytest.approx(0.7)
    biased = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((5, 1.0),))
    state.apply(steps.make([(1, 0, [3], True, biased)]))  # the req_index's next request replaces every parameter
    assert flags() == (False, False, False, True)
    assert state.penalty.repetition[1].item() == 1.0 and state.params["temperature"][1].item() == 0.0
    state.apply(steps.make([(1, 0, [3], True, GREEDY)]))
    assert flags() == (False, False, False, False)


def test_a_new_request_does_not_inherit_its_rows_logit_bias():
    """A request without logit_bias, new at a row whose last request had one, in a step whose other
    rows have none: the old entries must not stay on the device for a later biased step to apply."""
    config = engine_config()
    state = InputBatch(config.scheduler.max_num_seqs, config.max_blocks_per_seq, DeviceOps(CPU), vocab_size=512)
    steps = Steps(config)
    biased = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((5, 9.0), (7, -3.0)))
    state.apply(steps.make([(1, 0, [3], True, biased)]))
    assert state.penalty.bias_values[1, :2].tolist() == [9.0, -3.0]
    state.apply(steps.make([(1, 0, [4], True, GREEDY)]))
    assert state.penalty.bias_values[1].abs().sum().item() == 0 and state.host_num_bias[1] == 0


def test_an_upload_batch_keeps_each_arrays_dtype_and_shape_on_the_cuda_path():
    """Mixed dtypes and sizes share one staging buffer: every slice starts aligned for its dtype."""
    ops = FakeAsyncOps(CPU, SyncGuard())
    arrays = [
        np.arange(3, dtype=np.int64),
        np.linspace(0, 1, 5, dtype=np.float32),
        np.arange(6, dtype=np.int32).reshape(2, 3),
        np.zeros(0, dtype=np.int64),
        np.full((4, 6), -2.5, dtype=np.float32),
        np.array([2**40 + 1]),
    ]
    batch = UploadBatch()
    staged = [batch.add(a, a.dtype) for a in arrays] + [batch.add([7, 8])]
    batch.upload(ops)
    for s, a in zip(staged, arrays + [np.array([7, 8])], strict=True):
        assert s.dev.shape == a.shape and s.dev.numpy().dtype == a.dtype
        np.testing.assert_array_equal(s.dev.numpy(), a)
