"""Per-slot device state and the worker's start-up and per-step input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.common.messages import SamplingParams
from pipeline.gpu_worker.device import DeviceOps
from pipeline.gpu_worker.executor import ModelExecutor
from pipeline.gpu_worker.model_runner import ModelRunner
from pipeline.gpu_worker.slot_state import POISON_TOKEN_ID, SlotState
from tests.unit.test_no_host_sync import GREEDY, SAMPLED, Steps, engine_config, tiny_model

CPU = torch.device("cpu")


def test_slot_parameters_live_on_the_device_and_change_only_for_new_rows():
    config = engine_config()
    state = SlotState(config.max_num_seqs, config.max_blocks_per_seq, DeviceOps(CPU))
    assert state.token_cache.tolist() == [POISON_TOKEN_ID] * config.max_num_seqs
    steps = Steps(config)
    hot = SamplingParams(max_tokens=8, temperature=0.5, top_p=0.25, top_k=7, seed=-3)
    state.apply(steps.make([(2, 0, [1, 2, 3, 4, 5], True, hot), (5, 0, [1], True, GREEDY)]))
    assert state.temperature[[2, 5]].tolist() == [0.5, 0.0] and state.top_p[2].item() == 0.25
    assert state.top_k[2].item() == 7 and state.seed[2].item() == -3
    assert state.host_temperature[2] == 0.5 and state.host_top_k[2] == 7 and state.host_top_p[2] == 0.25
    per_slot = config.max_blocks_per_seq
    assert state.block_table[2, :2].tolist() == [2 * per_slot, 2 * per_slot + 1]
    # A later step of the same requests carries no parameters: the slots keep theirs.
    state.apply(steps.make([(2, 5, [9], True, None), (5, 1, [9], True, None)]))
    assert state.temperature[[2, 5]].tolist() == [0.5, 0.0] and state.seed[2].item() == -3
    # A new request in slot 5 replaces them.
    state.apply(steps.make([(5, 0, [1, 2], True, SAMPLED[1])]))
    assert state.temperature[5].item() == 1.0 and state.seed[5].item() == 3 and state.host_temperature[5] == 1.0


def test_max_model_len_beyond_the_rope_table_is_refused_at_start_up():
    model = tiny_model(max_position_embeddings=64)
    with pytest.raises(ValueError, match="max_model_len 128 exceeds the model's max_position_embeddings 64"):
        ModelExecutor(engine_config(max_model_len=128), model, CPU, torch.float32)


def test_token_ids_outside_the_vocabulary_are_refused_before_the_device_sees_them():
    config = engine_config()
    runner = ModelRunner(config, ModelExecutor(config, tiny_model(), CPU, torch.float32), CPU)
    steps = Steps(config)
    with pytest.raises(ValueError, match="token id 512 is outside the vocabulary of 512"):
        runner.launch(steps.make([(0, 0, [1, 512], True, GREEDY)]), 0)
    assert np.all(runner.slots.host_temperature == 0)  # nothing was applied
