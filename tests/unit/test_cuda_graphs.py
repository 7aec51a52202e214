"""CUDA graphs for decode-only steps: sizes, padding, and the graph body against the eager step.

On CPU nothing is captured, so a graph step runs the graph body eagerly on
the padded static buffers (pipeline/gpu_worker/cuda_graphs.py); these tests
check that body against the normal eager step, token for token, on the tiny
random Llama of tests/conftest.py, and the shape logic around it. The real
capture runs in the ``cuda``-marked tests (here and in test_no_host_sync.py),
which scripts/gpu_check.sh runs on a GPU.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from pipeline.common.config import EngineConfig
from pipeline.common.config_groups import SchedulerConfig, WorkerConfig
from pipeline.common.constants import cdiv
from pipeline.common.messages import SamplingParams
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID
from pipeline.gpu_worker.attention.backend import StepLayout, host_upload
from pipeline.gpu_worker.attention.graph_decode import GraphDecodeInputs
from pipeline.gpu_worker.cuda_graphs import DecodeGraphs, GraphStep, padded_size
from pipeline.gpu_worker.executor import PAD_BLOCKS, ModelExecutor
from pipeline.gpu_worker.model_runner import ModelRunner
from pipeline.gpu_worker.models.loader import load_model
from pipeline.server_args import build_parser
from pipeline.server_config import cuda_graph_sizes, make_config
from tests.conftest import make_tiny_model
from tests.unit.test_no_host_sync import Steps

BLOCK = 4
PH = PLACEHOLDER_TOKEN_ID
GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=64, temperature=0.9, top_p=0.9, top_k=40, seed=5)


def test_default_sizes_follow_vllm():
    assert cuda_graph_sizes(None, 256) == (1, 2, 4, *range(8, 257, 8))
    big = cuda_graph_sizes(None, 4096)
    assert big[:3] == (1, 2, 4) and big[-1] == 512
    assert big[3:] == (*range(8, 256, 8), *range(256, 513, 16))
    # max_num_seqs off the grid: the largest size is max_num_seqs itself, so every decode step fits a graph.
    assert cuda_graph_sizes(None, 100) == (1, 2, 4, *range(8, 97, 8), 100)
    assert cuda_graph_sizes(None, 3) == (1, 2, 3)


def test_explicit_sizes_are_sorted_and_capped(capsys):
    assert cuda_graph_sizes([8, 1, 8, 300], 256) == (1, 8)
    with pytest.raises(SystemExit):
        cuda_graph_sizes([4, 0], 256)
    assert "--cuda-graph-sizes" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("num_rows", "size"), [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 24), (24, 24), (25, None), (100, None)]
)
def test_a_step_pads_to_the_smallest_size_that_holds_it(num_rows, size):
    assert padded_size([1, 2, 4, 8, 16, 24], num_rows) == size


@pytest.mark.parametrize(
    ("flags", "sizes"),
    [
        (["--device", "cuda", "--max-num-seqs", "16"], (1, 2, 4, 8, 16)),
        (["--device", "cuda", "--max-num-seqs", "64", "--max-num-batched-tokens", "20"], (1, 2, 4, 8, 16, 20)),
        (["--device", "cuda", "--cuda-graph-sizes", "32", "1", "2", "999"], (1, 2, 32)),
        (["--device", "cuda", "--enforce-eager"], ()),
        (["--device", "cpu"], ()),  # accepted, and off: graphs are CUDA's
        (["--device", "cpu", "--cuda-graph-sizes", "1", "2"], ()),
    ],
)
def test_flags_make_the_config(tiny_dir, flags, sizes):
    args = build_parser().parse_args(["--model", str(tiny_dir), *flags])
    config = make_config(args)
    shutil.rmtree(config.ipc_dir)
    assert config.worker.cuda_graph_sizes == sizes


def test_help_explains_the_flags():
    text = " ".join(build_parser().format_help().split())
    assert "--cuda-graph-sizes N [N ...]" in text and "smallest size >= B" in text
    assert "--enforce-eager" in text and "capture no CUDA graphs" in text


def engine_config(max_num_seqs: int = 8) -> EngineConfig:
    max_model_len = 64
    return EngineConfig(
        model="tiny",
        served_model_name="tiny",
        max_model_len=max_model_len,
        num_kv_blocks=max_num_seqs * cdiv(max_model_len, BLOCK),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, block_size=BLOCK),
        worker=WorkerConfig(debug_token_cache_poison=True),
    )


def make_runner(model_dir, attention_backend: str, sizes=None, device: str = "cpu") -> ModelRunner:
    dev = torch.device(device)
    config = engine_config()
    model = load_model(str(model_dir), torch.float32, dev, attention_backend)
    runner = ModelRunner(config, ModelExecutor(config, model, dev, torch.float32), dev)
    if sizes:
        runner.executor.capture_decode_graphs(runner.input_batch.block_table, sizes)
    return runner


def decode_script(params: SamplingParams):
    """Prompts of varied lengths, then decode steps whose batch shrinks and grows, and one mixed step.

    Yields lists of rows ``(req_index, start, token ids, sampled, params or None)``;
    every decode input is a placeholder for the previous step's token.
    """
    rng = np.random.default_rng(1)
    lens = {0: 9, 1: 3, 2: 14, 3: 6, 4: 1}
    pos = dict(lens)
    yield [(s, 0, rng.integers(0, 49152, n).tolist(), True, params) for s, n in lens.items()]
    live = [0, 1, 2, 3, 4]
    for i in range(12):
        if i == 4:
            live.remove(1)  # a request finished: 4 rows
        if i == 6:
            live = [0, 2]  # 2 rows
        if i == 8:  # a new request's prompt beside the decodes: eager
            rows = [(s, pos[s], [PH], True, None) for s in live] + [(5, 0, [7, 8, 9, 10, 11], True, params)]
            pos[5] = 5
            for s in live:
                pos[s] += 1
            live = [0, 2, 5]
            yield rows
            continue
        yield [(s, pos[s], [PH], True, None) for s in live]
        for s in live:
            pos[s] += 1


def run(runner: ModelRunner, params: SamplingParams) -> list[list[int]]:
    steps = Steps(runner.config)
    out, pending = [], None
    for rows in decode_script(params):
        step = runner.launch(steps.make(rows), 0)  # launched before the previous step is collected
        if pending is not None:
            out.append(runner.finish(pending).tokens.tolist())
        pending = step
    out.append(runner.finish(pending).tokens.tolist())
    return out


@pytest.fixture()
def graph_sizes_run(monkeypatch):
    """The (rows, size) of every step that ran through DecodeGraphs.run."""
    seen = []
    original = DecodeGraphs.run

    def spy(self, step, input_ids):
        seen.append((step.num_tokens, step.size))
        return original(self, step, input_ids)

    monkeypatch.setattr(DecodeGraphs, "run", spy)
    return seen


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
@pytest.mark.parametrize("attention_backend", ["torch_bucketed", "torch_sdpa"])
def test_graph_body_equals_the_eager_step(tiny_dir, graph_sizes_run, attention_backend, kind):
    """The padded graph body, run eagerly, samples the eager step's tokens, through either cache layout."""
    params = GREEDY if kind == "greedy" else SAMPLED
    expected = run(make_runner(tiny_dir, attention_backend), params)
    assert graph_sizes_run == []
    tokens = run(make_runner(tiny_dir, attention_backend, sizes=[1, 2, 4]), params)
    assert tokens == expected
    # 5 rows and the mixed step run eagerly; 4 rows exactly, 3 padded to 4, 2 exactly.
    assert graph_sizes_run == [(4,) * 2] * 2 + [(2, 2)] * 2 + [(3, 4)] * 3, graph_sizes_run


@pytest.fixture(scope="module")
def tiny_gemma2_dir(tmp_path_factory, smol_dir):
    """Alternating sliding (8 keys) and full layers, soft-capped scores and logits."""
    from transformers import Gemma2Config

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-gemma2"),
        smol_dir,
        Gemma2Config,
        head_dim=16,
        initializer_range=1.0,
        sliding_window=8,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    )


def test_graph_body_applies_the_layers_window_and_softcap(tiny_gemma2_dir, graph_sizes_run):
    """Contexts grow past the window during the script: the graph body's masks must narrow as the eager step's."""
    expected = run(make_runner(tiny_gemma2_dir, "torch_bucketed"), SAMPLED)
    assert run(make_runner(tiny_gemma2_dir, "torch_bucketed", sizes=[1, 2, 4]), SAMPLED) == expected
    assert graph_sizes_run


def test_a_shift_moves_the_graph_rows_back():
    """Rows planned ahead of their true start (speculative decoding's upper bounds) plus the device shift
    give the graph the positions, slots, blocks and mask of the exact rows."""
    block_table = torch.arange(4 * 8, dtype=torch.int64).view(4, 8) * 3  # any block ids
    exact = StepLayout.build([1, 1, 1], [5, 9, 3], [0, 2, 3], BLOCK, 8)
    ahead = StepLayout.build([1, 1, 1], [7, 9, 6], [0, 2, 3], BLOCK, 8)
    a, b = (GraphDecodeInputs(4, block_table, pad_block=99, block_size=BLOCK) for _ in range(2))
    assert a.fill(exact, 4, host_upload).tolist() == [5, 9, 3]
    assert b.fill(ahead, 4, host_upload, torch.tensor([2, 0, 3])).tolist() == [5, 9, 3]
    ma, mb = a.metadata(4), b.metadata(4)
    for name in ("positions", "slot_mapping", "block_ids", "mask"):
        assert torch.equal(getattr(ma, name), getattr(mb, name)), name


def test_padding_rows_write_only_the_padding_block(tiny_dir):
    runner = make_runner(tiny_dir, "torch_bucketed", sizes=[8])
    graphs = runner.executor.graphs.inputs  # the static rows the graph reads
    steps = Steps(runner.config)
    rows = [(0, 0, [1, 2, 3, 4, 5], True, GREEDY), (3, 0, [6, 7], True, GREEDY), (6, 0, [9], True, GREEDY)]
    runner.finish(runner.launch(steps.make(rows), 0))
    before = [(k.clone(), v.clone()) for k, v in runner.executor.kv_caches]

    x = steps.make([(0, 5, [PH], True, None), (3, 2, [PH], True, None), (6, 1, [PH], True, None)])
    runner.finish(runner.launch(x, 0))

    pad = runner.config.num_kv_blocks
    assert pad == runner.executor.kv_caches[0][0].shape[0] // BLOCK - PAD_BLOCKS
    # Real rows: their req_index, position and context; padding rows: req_index -1, position 0, one token of context.
    assert graphs.rows[:, :8].tolist() == [
        [0, 3, 6, -1, -1, -1, -1, -1],
        [5, 2, 1, 0, 0, 0, 0, 0],
        [6, 3, 2, 1, 1, 1, 1, 1],
    ]
    table = runner.input_batch.block_table
    real = [int(table[s, p // BLOCK]) * BLOCK + p % BLOCK for s, p in ((0, 5), (3, 2), (6, 1))]
    assert graphs.slot_mapping[:8].tolist() == real + [pad * BLOCK] * 5
    for (k0, v0), (k1, v1) in zip(before, runner.executor.kv_caches):
        for old, new in ((k0, k1), (v0, v1)):
            # head-major: [KVH, slots, D]; find which flat slots changed
            changed = old.view(old.shape[1], -1, old.shape[2]) != new.view(new.shape[1], -1, new.shape[2])
            changed = torch.nonzero(changed.any(dim=2).any(dim=0)).flatten().tolist()
            assert set(changed) <= set(real) | {pad * BLOCK}
            assert pad * BLOCK in changed and set(real) <= set(changed)


def test_steps_that_do_not_fit_run_eagerly(tiny_dir):
    runner = make_runner(tiny_dir, "torch_bucketed", sizes=[1, 2])
    executor = runner.executor
    steps = Steps(runner.config)
    runner.finish(runner.launch(steps.make([(s, 0, [1, 2], True, GREEDY) for s in range(3)]), 0))
    from pipeline.gpu_worker.attention.backend import StepLayout

    def meta(rows):
        x = steps.make(rows)
        layout = StepLayout.build(
            x.num_scheduled_tokens, x.start_pos, x.req_index, BLOCK, runner.config.max_blocks_per_seq
        )
        return executor.build_metadata(layout, runner.input_batch.block_table, runner.ops.upload)

    assert isinstance(meta([(0, 2, [PH], True, None), (1, 2, [PH], True, None)]), GraphStep)
    assert not isinstance(meta([(s, 2, [PH], True, None) for s in range(3)]), GraphStep)  # 3 rows > 2
    assert not isinstance(meta([(0, 2, [PH], True, None), (1, 2, [5, 6], True, None)]), GraphStep)  # prefill


def test_a_cache_without_the_padding_block_is_refused(tiny_dir):
    runner = make_runner(tiny_dir, "torch_bucketed")
    with pytest.raises(ValueError, match="padding block"):
        DecodeGraphs(
            runner.executor.model,
            runner.executor.attn_backend,
            runner.executor.kv_caches,
            runner.input_batch.block_table,
            [1],
            BLOCK,
            pad_block=runner.config.num_kv_blocks + 1,
        )


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
@pytest.mark.parametrize("attention_backend", ["torch_bucketed", "torch_sdpa"])
def test_captured_graphs_equal_eager_on_cuda(tiny_dir, graph_sizes_run, attention_backend, kind):
    """Real capture and replay: the same tokens as the eager CUDA path, with the sizes of the CPU test."""
    params = GREEDY if kind == "greedy" else SAMPLED
    expected = run(make_runner(tiny_dir, attention_backend, device="cuda"), params)
    runner = make_runner(tiny_dir, attention_backend, sizes=[1, 2, 4], device="cuda")
    assert sorted(runner.executor.graphs._graphs) == [1, 2, 4]
    assert run(runner, params) == expected
    assert len(graph_sizes_run) == 7
