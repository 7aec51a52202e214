"""No step may wait for the device: ``ModelRunner.launch`` under a sync guard.

On CPU, ``SyncGuard`` watches the CUDA code path
of the runner (``FakeAsyncOps``: pinned staging,
non-blocking uploads, copy stream, events) on a tiny random Llama, and fails
on any call that would synchronise a CUDA stream. The steps cover prefill,
decode and mixed prefill+decode, greedy and sampled rows (temperature,
top-k, top-p, seeds), penalties and biases (counts updated on the device),
placeholders resolved in flight (step N+1 launched before N is finished),
with poison mode on, through each CPU attention backend (torch_bucketed,
torch_sdpa), eagerly and through the CUDA graph path of decode-only steps
(captured on CUDA). On a CUDA machine the same
steps run under ``torch.cuda.set_sync_debug_mode("error")``, and a marker
event queued behind ``torch.cuda._sleep`` must still be pending when
``launch`` returns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from pipeline.common.config import EngineConfig
from pipeline.common.config_groups import SchedulerConfig, WorkerConfig
from pipeline.common.constants import cdiv
from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.messages import SamplingParams
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID, StepDescriptor, read_descriptor
from pipeline.gpu_worker.device import DeviceOps
from pipeline.gpu_worker.executor import ModelExecutor
from pipeline.gpu_worker.launched_step import StaleTokenError
from pipeline.gpu_worker.model_runner import ModelRunner
from pipeline.gpu_worker.models.base import CausalLM
from pipeline.gpu_worker.sampling import sampler
from tests.reference import ours_from_hf
from tests.unit.sync_guard import FakeAsyncOps, FakeEvent, SyncGuard

BLOCK = 4
GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
SAMPLED = [
    SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, top_k=20, seed=7),
    SamplingParams(max_tokens=64, temperature=1.0, top_p=0.9, seed=3),
    SamplingParams(max_tokens=64, temperature=1.3, top_k=5, seed=11),
    SamplingParams(max_tokens=64, temperature=0.7, seed=2**62 + 5),
]
PENALIZED = [
    SamplingParams(
        max_tokens=64,
        temperature=0.0,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        min_tokens=3,
        stop_token_ids=(5, 9),
        logit_bias=((3, 4.0), (8, -50.0)),
    ),
    SamplingParams(max_tokens=64, temperature=0.9, top_p=0.9, seed=5, repetition_penalty=1.3, min_p=0.1),
    SamplingParams(max_tokens=64, temperature=1.1, top_k=20, seed=6, min_p=0.05, logit_bias=((1, -100.0),)),
    GREEDY,
]
# The scenario's decode-only steps have 3, 4 and 1 rows: padded, exact and exact.
GRAPH_SIZES = (1, 4)
PARAMS = {
    "greedy": [GREEDY] * 4,
    "sampled": SAMPLED,
    "mixed": [GREEDY, SAMPLED[0], SAMPLED[1], SAMPLED[2]],
    "penalized": PENALIZED,
}


def tiny_model(
    max_position_embeddings: int = 256,
    attention_backend: str = "auto",
    vocab_size: int = 512,
    heads: tuple[int, int, int] = (4, 2, 16),
) -> CausalLM:
    """A random 2-layer Llama; ``heads``: (query heads, KV heads, head size)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=heads[0] * heads[2],
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        max_position_embeddings=max_position_embeddings,
    )
    return ours_from_hf(transformers.LlamaForCausalLM(cfg), attention_backend=attention_backend)


def engine_config(max_model_len: int = 128) -> EngineConfig:
    return EngineConfig(
        model="tiny",
        served_model_name="tiny",
        max_model_len=max_model_len,
        num_kv_blocks=8 * cdiv(max_model_len, BLOCK),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=BLOCK),
        worker=WorkerConfig(debug_token_cache_poison=True),
    )


class Steps:
    """Writes descriptors the way the scheduler does: real ids or placeholders, blocks on demand."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.layout = config.descriptor_layout
        self.blocks = {}  # req_index -> blocks allocated
        self.step_id = 0

    def make(self, rows):
        """``rows``: ``(req_index, start_pos, token_ids, do_sample, new_params or None)``; req_num = req_index."""
        b = DescriptorBuilder()
        per_row = cdiv(self.config.max_model_len, BLOCK)
        for req_index, start, ids, do_sample, params in rows:
            b.add_row(req_index, req_index, start, ids, do_sample, params)
            have = self.blocks.get(req_index, 0)
            for i in range(have, cdiv(start + len(ids), BLOCK)):
                b.add_block(req_index, i, req_index * per_row + i)
            self.blocks[req_index] = max(have, cdiv(start + len(ids), BLOCK))
        desc = StepDescriptor(self.layout.views(bytearray(self.layout.nbytes)))
        b.write(desc, self.step_id)
        self.step_id += 1
        return read_descriptor(desc)


def run_scenario(runner: ModelRunner, params: list[SamplingParams], launch, finish) -> list[list[int]]:
    """Prefill, decode and mixed steps, each launched before the previous one is finished.

    ``launch(x)`` launches a step, ``finish(step)`` collects it; returns each step's tokens.
    """
    ph = PLACEHOLDER_TOKEN_ID
    steps = Steps(runner.config)
    a, b, c, d = params
    script = [
        # prefill only: three new requests
        [(0, 0, [5, 6, 7, 8, 9, 10], True, a), (1, 0, list(range(20, 29)), True, b), (2, 0, [3, 1, 4], True, c)],
        # decode only, every input a placeholder for the token step 0 is still computing
        [(0, 6, [ph], True, None), (1, 9, [ph], True, None), (2, 3, [ph], True, None)],
        # mixed: decodes plus the first chunk of a new prompt (not sampled)
        [
            (0, 7, [ph], True, None),
            (3, 0, [40, 41, 42, 43, 44], False, d),
            (1, 10, [ph], True, None),
            (2, 4, [ph], True, None),
        ],
        # mixed: the prompt's last chunk is sampled
        [
            (3, 5, [45, 46, 47], True, None),
            (0, 8, [ph], True, None),
            (1, 11, [ph], True, None),
            (2, 5, [ph], True, None),
        ],
        [(0, 9, [ph], True, None), (1, 12, [ph], True, None), (2, 6, [ph], True, None), (3, 8, [ph], True, None)],
        # one greedy row alone
        [(0, 10, [ph], True, None)],
    ]
    out, pending = [], None
    for rows in script:
        step = launch(steps.make(rows))
        if pending is not None:
            out.append(finish(pending).tokens.tolist())
        pending = step
    out.append(finish(pending).tokens.tolist())
    return out


@pytest.fixture()
def guard(monkeypatch):
    g = SyncGuard()
    # Device tensors cached across tests were made before this guard could tag them.
    monkeypatch.setattr(sampler, "_COUNTER_BITS", {})
    for cls in (torch.cuda.Event, torch.cuda.Stream):
        monkeypatch.setattr(cls, "synchronize", lambda self, _n=cls.__name__: g.flag(f"{_n}.synchronize"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: g.flag("torch.cuda.synchronize"))
    return g


def guarded_runner(
    guard: SyncGuard, config: EngineConfig, attention_backend: str = "auto", graph_sizes: tuple[int, ...] = ()
) -> ModelRunner:
    """A runner on the CUDA code path, its device state known to ``guard``; ``graph_sizes``: decode graphs."""
    model = tiny_model(attention_backend=attention_backend)
    guard.mark_device(*model.parameters(), *model.buffers())
    cpu = torch.device("cpu")
    with guard, guard.paused():  # device allocations are made under the mode so it tags them
        runner = ModelRunner(config, ModelExecutor(config, model, cpu, torch.float32), cpu, FakeAsyncOps(cpu, guard))
        if graph_sizes:
            runner.executor.capture_decode_graphs(runner.input_batch.block_table, graph_sizes)
        return runner


@pytest.mark.parametrize("kind", ["greedy", "sampled", "mixed", "penalized"])
@pytest.mark.parametrize("attention_backend", ["torch_bucketed", "torch_sdpa"])
@pytest.mark.parametrize("graphs", ["eager", "graphs"])
def test_launch_never_syncs(guard, kind, attention_backend, graphs):
    """With ``graphs``, decode-only steps take the CUDA graph path (its body run eagerly: no capture on CPU)."""
    config = engine_config()
    runner = guarded_runner(guard, config, attention_backend, GRAPH_SIZES if graphs == "graphs" else ())

    def launch(x):
        with guard:
            return runner.launch(x, 0)

    def finish(step):
        with guard, guard.paused():  # finish waits for the step by design
            return runner.finish(step)

    tokens = run_scenario(runner, PARAMS[kind], launch, finish)
    assert guard.violations == [], "\n".join(guard.violations)

    # The CUDA code path computes what the synchronous CPU path computes.
    cpu = torch.device("cpu")
    model = tiny_model(attention_backend=attention_backend)
    reference = ModelRunner(config, ModelExecutor(config, model, cpu, torch.float32), cpu, DeviceOps(cpu))
    expected = run_scenario(reference, PARAMS[kind], lambda x: reference.launch(x, 0), reference.finish)
    assert tokens == expected
    assert all(0 <= t < 512 for step in tokens for t in step)


def test_stale_placeholder_is_reported_by_finish_not_launch(guard):
    """Poison mode: the check is a device flag that travels with the tokens."""
    runner = guarded_runner(guard, engine_config())
    steps = Steps(runner.config)
    with guard:
        first = runner.launch(steps.make([(0, 0, [1, 2, 3], True, GREEDY), (1, 0, [4, 5], True, GREEDY)]), 0)
        # Req_index 1's token is consumed (and not replaced: nothing sampled), then read again.
        second = runner.launch(steps.make([(1, 2, [PLACEHOLDER_TOKEN_ID], False, None)]), 0)
        third = runner.launch(
            steps.make([(0, 3, [PLACEHOLDER_TOKEN_ID], True, None), (1, 3, [PLACEHOLDER_TOKEN_ID], True, None)]), 0
        )
    assert guard.violations == [], guard.violations
    with guard.paused():
        runner.finish(first)
        runner.finish(second)
        with pytest.raises(StaleTokenError, match=r"step 2: placeholder for req_indices \[1\]"):
            runner.finish(third)


def test_guard_catches_syncs(guard):
    """The guard itself: each kind of sync is flagged, the legitimate transfers are not."""
    ops = FakeAsyncOps(torch.device("cpu"), guard)
    with guard:
        d = torch.arange(6, device="cpu")  # explicit device=: a device tensor
        (up,) = ops.upload([np.arange(3)])
        host, done = ops.copy_to_host(d)
        assert guard.violations == []
        for sync in (
            lambda: bool((d > 2).any()),
            lambda: d.sum().item(),
            lambda: d.tolist(),
            lambda: d.cpu(),
            lambda: d.numpy(),
            lambda: int(d[0]),
            lambda: torch.nonzero(d),
            lambda: d[d > 2],
            lambda: torch.arange(6).to("cpu"),
            lambda: d.new_empty(6).copy_(torch.arange(6)),
            lambda: torch.arange(6).copy_(d),
            lambda: d[torch.arange(2)],
            lambda: torch.tensor([1, 2], device="cpu"),
            lambda: FakeEvent(guard, False).synchronize(),
            lambda: ops.copy_stream.synchronize(),
            lambda: torch.cuda.synchronize(),
        ):
            n = len(guard.violations)
            sync()
            assert len(guard.violations) == n + 1, guard.violations[n:]
    assert up.tolist() == [0, 1, 2] and host.tolist() == d.tolist() and done.query()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_runner(max_model_len: int = 128, graphs: str = "eager") -> ModelRunner:
    """A CUDA runner; ``graphs == "graphs"`` captures decode graphs of ``GRAPH_SIZES``."""
    config = engine_config(max_model_len)
    dev = torch.device("cuda")
    model = tiny_model(max(256, max_model_len)).to(dev)
    runner = ModelRunner(config, ModelExecutor(config, model, dev, torch.float32), dev)
    if graphs == "graphs":
        runner.executor.capture_decode_graphs(runner.input_batch.block_table, GRAPH_SIZES)
    return runner


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", ["greedy", "sampled", "mixed", "penalized"])
@pytest.mark.parametrize("graphs", ["eager", "graphs"])
def test_launch_never_syncs_on_cuda(kind, graphs):
    runner = cuda_runner(graphs=graphs)
    warm = cuda_runner(graphs=graphs)  # first calls may initialise CUDA libraries (cuBLAS handles, kernels)
    run_scenario(warm, PARAMS[kind], lambda x: warm.launch(x, 0), warm.finish)

    def launch(x):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return runner.launch(x, 0)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    tokens = run_scenario(runner, PARAMS[kind], launch, runner.finish)
    assert all(0 <= t < 512 for step in tokens for t in step)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", ["greedy", "sampled", "long_context"])
@pytest.mark.parametrize("graphs", ["eager", "graphs"])
def test_launch_returns_while_the_device_is_busy(kind, graphs):
    """A marker queued behind a long device sleep is still pending when launch() returns."""
    long = kind == "long_context"
    runner = cuda_runner(4096 if long else 128, graphs)
    params = GREEDY if kind == "greedy" else SAMPLED[0]
    steps = Steps(runner.config)
    prompt = list(np.random.default_rng(0).integers(0, 512, 3000 if long else 7))
    start, chunk = 0, 64
    while start < len(prompt):  # prefill in chunks; also warms everything up
        ids = prompt[start : start + chunk]
        new = params if start == 0 else None
        runner.finish(runner.launch(steps.make([(0, start, ids, start + len(ids) == len(prompt), new)]), 0))
        start += len(ids)
    torch.cuda.synchronize()
    for i in range(3):
        torch.cuda._sleep(int(2e8))  # ~0.1 s of device time
        marker = torch.cuda.Event()
        marker.record()
        step = runner.launch(steps.make([(0, len(prompt) + i, [PLACEHOLDER_TOKEN_ID], True, None)]), 0)
        assert not marker.query(), "launch() waited for the device"
        step.done.synchronize()
        runner.finish(step)
