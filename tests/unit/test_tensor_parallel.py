"""Tensor-parallel sharding: the split, each rank's weights, and a sharded forward over gloo."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from pipeline.common.tp_shape import TPShape
from pipeline.gpu_worker.layers.tp import TPGroup
from pipeline.gpu_worker.models.loader import load_model

CPU = torch.device("cpu")
BLOCK_SIZE = 16
HEAD_DIM = 8
# 515 tokens: no size divides it, so the last rank's vocabulary rows are padded.
CONFIG = dict(
    vocab_size=515,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attention_bias=True,
    mlp_bias=True,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny-kv4")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(d)
    return str(d)


def test_split_and_replication():
    s = TPShape.build(2, num_heads=8, num_kv_heads=4, intermediate_size=128, vocab_size=515)
    assert (s.num_heads, s.num_kv_heads, s.kv_replicas, s.intermediate_size, s.vocab_per_rank) == (4, 2, 1, 64, 258)
    assert [s.kv_head_start(r) for r in range(2)] == [0, 2]
    # More ranks than KV heads: one KV head per rank, each on two ranks, next to its query heads.
    s = TPShape.build(8, num_heads=8, num_kv_heads=4, intermediate_size=128, vocab_size=515)
    assert (s.num_heads, s.num_kv_heads, s.kv_replicas) == (1, 1, 2)
    assert [s.kv_head_start(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("size", [3, 6, 16])
def test_sizes_that_do_not_fit_are_refused(size):
    with pytest.raises(ValueError, match=rf"size {size} does not divide.*supports sizes \[1, 2, 4, 8\]"):
        TPShape.build(size, num_heads=8, num_kv_heads=4, intermediate_size=128, vocab_size=515)


def test_serve_refuses_a_size_that_does_not_fit(tiny_kv4_dir, capsys):
    from pipeline.server_args import build_parser
    from pipeline.server_config import make_config

    with pytest.raises(SystemExit) as e:
        make_config(build_parser().parse_args(["--model", str(tiny_kv4_dir), "-tp", "3", "--device", "cpu"]))
    assert e.value.code == 2
    assert "--tensor-parallel-size: tensor-parallel size 3 does not divide 8 attention heads" in capsys.readouterr().err


def test_kv_cache_is_sized_per_rank(tiny_kv4_dir):
    from pipeline.server_args import build_parser
    from pipeline.server_config import make_config

    def blocks(tp: int) -> int:
        args = build_parser().parse_args(
            ["--model", str(tiny_kv4_dir), "-tp", str(tp), "--device", "cpu", "--kv-cache-memory", "0.01"]
        )
        return make_config(args).num_kv_blocks

    # Each rank holds half the KV heads of every block: the same memory per device holds twice the blocks.
    assert blocks(2) in (2 * blocks(1), 2 * blocks(1) + 1)  # rounded down either way


def expected_slice(sd: dict[str, torch.Tensor], name: str, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of our parameter ``name``, cut from the full transformers tensors by hand."""
    shape = TPShape.build(size, 8, 4, 128, 515)
    h, kv = shape.num_heads * HEAD_DIM, shape.num_kv_heads * HEAD_DIM
    i, v = shape.intermediate_size, shape.vocab_per_rank
    kv0 = shape.kv_head_start(rank) * HEAD_DIM

    def rows(t, a, n):
        return t[a : a + n]

    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        full = sd[name]
        padded = torch.cat([full, full.new_zeros(size * v - full.shape[0], full.shape[1])])
        return rows(padded, rank * v, v)
    if name == "model.norm.weight":
        return sd[name]
    head, proj, kind = name.rsplit(".", 2)
    p = head + "."
    if proj == "qkv_proj":
        return torch.cat(
            [
                rows(sd[p + f"q_proj.{kind}"], rank * h, h),
                rows(sd[p + f"k_proj.{kind}"], kv0, kv),
                rows(sd[p + f"v_proj.{kind}"], kv0, kv),
            ]
        )
    if proj == "gate_up_proj":
        return torch.cat([rows(sd[p + f"gate_proj.{kind}"], rank * i, i), rows(sd[p + f"up_proj.{kind}"], rank * i, i)])
    if (proj, kind) == ("o_proj", "weight"):
        return sd[name][:, rank * h : (rank + 1) * h]
    if (proj, kind) == ("down_proj", "weight"):
        return sd[name][:, rank * i : (rank + 1) * i]
    return sd[name]  # the norms, and the row-parallel layers' biases: whole, added once after the sum


@pytest.mark.parametrize("size", [2, 4, 8])
def test_each_rank_loads_exactly_its_slice(model_dir, size):
    from safetensors.torch import load_file

    sd = load_file(f"{model_dir}/model.safetensors")
    full_numel = sum(p.numel() for p in load_model(model_dir, torch.float32, CPU).parameters())
    for rank in range(size):
        shard = load_model(model_dir, torch.float32, CPU, tp=TPGroup(rank, size))
        params = dict(shard.named_parameters())
        # Embedding, LM head, final norm; per layer two norms and four fused projections with biases.
        assert len(params) == 3 + 10 * CONFIG["num_hidden_layers"]
        for name, value in params.items():
            assert torch.equal(value.to_dense(), expected_slice(sd, name, rank, size)), (rank, name)
        assert sum(p.numel() for p in params.values()) < full_numel / 1.5  # no rank holds the whole model
        assert shard.config.vocab_size == 515  # the executor still sees the full vocabulary


def _sharded_logits(rank: int, size: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=size)
    model = load_model(model_dir, torch.float32, CPU, tp=TPGroup(rank, size, dist.group.WORLD))
    torch.save(_two_steps(model), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def _two_steps(model) -> list[torch.Tensor]:
    """A chunked prefill of two requests, then a decode reading the paged cache; logits of both steps."""
    torch.manual_seed(1)
    caches = model.allocate_kv_caches(8, BLOCK_SIZE, torch.float32, CPU)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    prompts = torch.randint(0, 515, (2, 20))
    results = []
    for starts, lens in (([0, 0], [20, 12]), ([20, 12], [1, 8])):
        ids = torch.cat(
            [prompts[r, s : s + n] if s + n <= 20 else torch.tensor([7]) for r, (s, n) in enumerate(zip(starts, lens))]
        )
        meta = model.attn_backend.build_from_rows(torch.tensor(lens), torch.tensor(starts), table, BLOCK_SIZE)
        with torch.inference_mode():
            hidden = model(ids, meta.positions, meta, caches)
            results.append(model.compute_logits(hidden[torch.cumsum(torch.tensor(lens), 0) - 1]))
    return results


def test_sharded_forward_equals_full_model(model_dir, tmp_path):
    """Two gloo ranks: both get the full model's logits (to float32 rounding), and the same ones."""
    full = _two_steps(load_model(model_dir, torch.float32, CPU))
    mp.spawn(_sharded_logits, args=(2, model_dir, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r0, r1, ref in zip(*ranks, full):
        assert torch.equal(r0, r1)  # every rank samples from the same logits
        torch.testing.assert_close(r0, ref, rtol=1e-5, atol=1e-5)


def test_help_explains_the_flag():
    from pipeline.server_args import build_parser

    assert "-tp TENSOR_PARALLEL_SIZE, --tensor-parallel-size" in build_parser().format_help()
