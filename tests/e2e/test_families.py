"""Every model family against transformers, on tiny random checkpoints loaded through our loader.

Each family's model is built offline with ``AutoModelForCausalLM.from_config``,
then *every* parameter is perturbed (``from_config`` zeroes biases and sets
norms to constants, which would hide a bias or norm bug), and it is saved as
safetensors, unsharded and sharded. Two requests are prefilled in chunks and
then decode 32 greedy steps through the paged cache; at each step our logits
must match transformers' (run over the same tokens) to 1e-4 in float32, and
our greedy token must be its argmax, on every CPU attention backend and
over two gloo ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from pipeline.common.model_files import checkpoint_files
from pipeline.gpu_worker.attention import cpu_paged, make_backend
from pipeline.gpu_worker.layers.tp import TPGroup
from pipeline.gpu_worker.models.loader import load_model
from tests.reference import NEAR_TIE

CPU = torch.device("cpu")
BLOCK = 16
STEPS = 32
PROMPTS = (40, 23)
CHUNK = 16
# head_dim 64 with two query heads per KV head: a shape the cpu_paged kernel is built for.
BASE = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    initializer_range=0.2,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3)),
    "llama-tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    # Mistral's default sliding window (4096) is longer than any sequence here: full attention.
    "mistral": (transformers.MistralConfig, dict(num_key_value_heads=1)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(hidden_size=96)),  # head_dim != hidden / heads
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    "qwen3-moe-unnormalised": (
        transformers.Qwen3MoeConfig,
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False),
    ),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    # The sequences (56 and 72 tokens) outrun the pre-training length, so transformers uses the long factors too.
    "phi3": (
        transformers.Phi3Config,
        dict(
            num_attention_heads=2,  # Phi-3 derives head_dim (64) from hidden / heads
            num_key_value_heads=1,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=48,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=[1.0 + i / 24 for i in range(24)],
                long_factor=[1.0 + i / 6 for i in range(24)],
            ),
        ),
    ),
    "gemma": (transformers.GemmaConfig, dict(tie_word_embeddings=True)),
    # Sliding windows of 8-16 keys, so that the prompts (40 and 23 tokens, prefilled 16 at a time) and the
    # decode steps cross them: on every layer (Mistral), past max_window_layers (Qwen2), alternating (Gemma).
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=8)),
    "qwen2-window": (
        transformers.Qwen2Config,
        dict(use_sliding_window=True, sliding_window=12, max_window_layers=1, num_hidden_layers=3),
    ),
    "gemma2": (
        transformers.Gemma2Config,
        dict(sliding_window=8, query_pre_attn_scalar=48, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            sliding_window=16,
            num_hidden_layers=3,
            sliding_window_pattern=3,
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                "sliding_attention": dict(rope_type="default", rope_theta=1e4),
            },
        ),
    ),
    "gemma3-multimodal": (
        lambda **text: transformers.Gemma3Config(
            text_config={**text, "sliding_window": 8},
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
            mm_tokens_per_image=4,
        ),
        {},
    ),
}
BACKENDS = ["torch_sdpa", "torch_bucketed", "cpu_paged"]


def perturbed(config_cls, fields: dict, seed: int = 0):
    """A random model of ``config_cls`` with every parameter moved off its initial value."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**{**BASE, **fields}), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, unsharded dir, sharded dir), built once."""
    out = {}
    for name, (cls, fields) in FAMILIES.items():
        hf = perturbed(cls, fields)
        whole, sharded = tmp_path_factory.mktemp(name), tmp_path_factory.mktemp(name + "-sharded")
        hf.save_pretrained(whole)
        hf.save_pretrained(sharded, max_shard_size="100KB")
        out[name] = (hf, str(whole), str(sharded))
    return out


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, BASE["vocab_size"], (n,), generator=gen).tolist() for n in PROMPTS]


@torch.inference_mode()
def run_greedy(model, steps: int = STEPS) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill each prompt in chunks of CHUNK, both requests in every step, then decode ``steps`` greedy tokens.

    Returns each request's tokens (prompt and output; the shorter prompt's
    request decodes one step more) and, per request, the ``[outputs, vocab]``
    logits that chose its output tokens.
    """
    seqs = prompts()
    width = -(-(max(PROMPTS) + steps) // BLOCK)
    table = torch.arange(len(seqs) * width).view(len(seqs), width).flip(1)  # non-contiguous, reversed blocks
    kv = model.allocate_kv_caches(len(seqs) * width, BLOCK, torch.float32, CPU)
    done = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(len(s) - n < steps for s, n in zip(seqs, PROMPTS, strict=True)):
        chunks = [s[done[i] : done[i] + CHUNK] for i, s in enumerate(seqs)]
        lens = torch.tensor([len(c) for c in chunks])
        meta = model.attn_backend.build_from_rows(lens, torch.tensor(done), table, BLOCK)
        hidden = model(torch.tensor([t for c in chunks for t in c]), meta.positions, meta, kv)
        rows = model.compute_logits(hidden[torch.cumsum(lens, 0) - 1])
        for i, c in enumerate(chunks):
            done[i] += len(c)
            if done[i] == len(seqs[i]):  # the prompt is in: sample
                logits[i].append(rows[i])
                seqs[i].append(int(rows[i].argmax()))
    return seqs, [torch.stack(x) for x in logits]


@torch.inference_mode()
def check_against_transformers(hf, seqs: list[list[int]], logits: list[torch.Tensor]) -> None:
    """Our logits equal transformers' over the same tokens, and our tokens are its greedy choices."""
    for seq, ours, n in zip(seqs, logits, PROMPTS, strict=True):
        ref = hf(torch.tensor([seq])).logits[0, n - 1 : -1]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
        for step, (token, row) in enumerate(zip(seq[n:], ref, strict=True)):
            best = int(row.argmax())
            if token != best:  # only at a genuine near-tie of the reference
                assert float(row[best] - row[token]) < NEAR_TIE, (step, token, best)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers_on_every_backend(checkpoints, family):
    hf, whole, sharded = checkpoints[family]
    assert len(checkpoint_files(Path(sharded))) > 1
    model = load_model(whole, torch.float32, CPU)
    from_shards = load_model(sharded, torch.float32, CPU)
    for (name, p), q in zip(model.named_parameters(), from_shards.parameters(), strict=True):
        assert torch.equal(p.to_dense(), q.to_dense()), name
    for backend in BACKENDS:
        if backend == "cpu_paged" and cpu_paged.unavailable_reason() is not None:
            continue
        model.attn_backend = make_backend(
            backend, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim
        )
        check_against_transformers(hf, *run_greedy(model))


def _rank_logits(rank: int, size: int, dirs: dict[str, str], out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=size)
    results = {}
    for family, d in dirs.items():
        model = load_model(d, torch.float32, CPU, tp=TPGroup(rank, size, dist.group.WORLD))
        results[family] = run_greedy(model)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_families_over_two_ranks(checkpoints, tmp_path):
    """Every family split over two gloo ranks: each rank's logits equal transformers' and the other rank's."""
    dirs = {name: whole for name, (_, whole, _) in checkpoints.items()}
    mp.spawn(_rank_logits, args=(2, dirs, str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for family, (hf, _, _) in checkpoints.items():
        (seqs, logits), (seqs1, logits1) = r0[family], r1[family]
        assert seqs == seqs1, family
        for a, b in zip(logits, logits1, strict=True):
            assert torch.equal(a, b), family  # every rank samples from the same logits
        check_against_transformers(hf, seqs, logits)
