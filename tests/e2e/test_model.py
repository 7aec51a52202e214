"""The paged Llama model against transformers, on a tiny random Llama (other families: test_families.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

from pipeline.gpu_worker.attention.torch_sdpa import TorchSDPABackend, paged_attention
from pipeline.gpu_worker.models.base import CausalLM, CheckpointError
from pipeline.gpu_worker.models.loader import load_model
from tests.reference import ours_from_hf

BLOCK_SIZE = 16
CPU = torch.device("cpu")
# The torch_sdpa backend's own metadata (its layout tests); one block-table row per request, on the host.
build_metadata = TorchSDPABackend().build_from_rows


def tiny_config(**overrides) -> transformers.LlamaConfig:
    fields = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    fields.update(overrides)
    return transformers.LlamaConfig(**fields)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(tiny_config()).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(hf_dir) -> CausalLM:
    return load_model(hf_dir, torch.float32, CPU)


def run_step(model, kv_caches, chunks, block_tables):
    """One forward over ``chunks`` = [(seq, start, token_ids)]; logits of each chunk's last token."""
    query_lens = torch.tensor([len(ids) for _, _, ids in chunks])
    starts = torch.tensor([start for _, start, _ in chunks])
    table = torch.stack([block_tables[seq] for seq, _, _ in chunks])
    meta = model.attn_backend.build_from_rows(query_lens, starts, table, BLOCK_SIZE)
    input_ids = torch.tensor([t for _, _, ids in chunks for t in ids])
    with torch.inference_mode():
        hidden = model(input_ids, meta.positions, meta, kv_caches)
        return model.compute_logits(hidden[torch.cumsum(query_lens, 0) - 1])


def shuffled_block_tables(num_seqs: int, blocks_per_seq: int, seed: int) -> tuple[int, list[torch.Tensor]]:
    """Non-contiguous, interleaved block ids; unused table entries hold -1."""
    num_blocks = num_seqs * blocks_per_seq + 3
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = []
    for i in range(num_seqs):
        row = torch.full((blocks_per_seq + 2,), -1, dtype=torch.int32)
        row[:blocks_per_seq] = ids[i::num_seqs][:blocks_per_seq].int()
        tables.append(row)
    return num_blocks, tables


@pytest.mark.parametrize("tie", [False, True])
def test_prompt_logits_match_transformers(tie):
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(tiny_config(tie_word_embeddings=tie)).eval()
    ours = ours_from_hf(hf)
    prompt = torch.randint(0, 512, (45,))
    with torch.inference_mode():
        expected = hf(prompt[None]).logits[0]
        meta = ours.attn_backend.build_from_rows(
            torch.tensor([45]), torch.tensor([0]), torch.tensor([[5, 2, 9]]), BLOCK_SIZE
        )
        kv = ours.allocate_kv_caches(10, BLOCK_SIZE, torch.float32, CPU)
        logits = ours.compute_logits(ours(prompt, meta.positions, meta, kv))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_llama3_rope_matches_transformers():
    torch.manual_seed(2)
    rope = dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    hf = transformers.LlamaForCausalLM(tiny_config(rope_parameters=rope)).eval()
    ours = ours_from_hf(hf)
    prompt = torch.randint(0, 512, (200,))
    with torch.inference_mode():
        expected = hf(prompt[None]).logits[0]
        table = torch.arange(13)[None]
        meta = ours.attn_backend.build_from_rows(torch.tensor([200]), torch.tensor([0]), table, BLOCK_SIZE)
        kv = ours.allocate_kv_caches(13, BLOCK_SIZE, torch.float32, CPU)
        logits = ours.compute_logits(ours(prompt, meta.positions, meta, kv))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_unsupported_rope_type_is_rejected():
    hf = transformers.LlamaForCausalLM(tiny_config())
    hf.config.rope_parameters = dict(rope_type="ntk-by-parts", rope_theta=10000.0, factor=4.0)
    with pytest.raises(ValueError, match="RoPE type 'ntk-by-parts' is not supported; supported: default, linear"):
        ours_from_hf(hf)


def test_greedy_paged_generation_matches_hf_generate(model, hf_model):
    """Chunked prefill of uneven sizes, then decode, four sequences batched together."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 37, 60, 18)]
    num_new = 10
    chunk_sizes = [7, 16, 3, 25, 11]
    num_blocks, tables = shuffled_block_tables(len(prompts), blocks_per_seq=5, seed=4)
    kv = model.allocate_kv_caches(num_blocks, BLOCK_SIZE, torch.float32, CPU)

    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)  # tokens whose K/V are in the cache
    step = 0
    while any(len(t) < len(p) + num_new for t, p in zip(tokens, prompts, strict=True)):
        chunks = []
        for seq, toks in enumerate(tokens):
            if len(toks) >= len(prompts[seq]) + num_new:
                continue
            size = chunk_sizes[(step + seq) % len(chunk_sizes)]
            chunk = toks[computed[seq] : computed[seq] + size]
            chunks.append((seq, computed[seq], chunk))
        logits = run_step(model, kv, chunks, tables)
        for (seq, start, chunk), row in zip(chunks, logits, strict=True):
            computed[seq] = start + len(chunk)
            if computed[seq] == len(tokens[seq]):  # prompt done or decoding: sample
                tokens[seq].append(int(row.argmax()))
        step += 1

    for prompt, toks in zip(prompts, tokens, strict=True):
        expected = hf_model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=num_new, eos_token_id=None, pad_token_id=0
        )[0].tolist()
        assert toks == expected


def test_mixed_step_equals_separate_steps(model):
    """A prefill chunk batched with decodes gives the logits each gets alone."""
    gen = torch.Generator().manual_seed(5)
    history = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (20, 33, 9, 40)]
    num_blocks, tables = shuffled_block_tables(4, blocks_per_seq=4, seed=6)
    kv = model.allocate_kv_caches(num_blocks, BLOCK_SIZE, torch.float32, CPU)
    # Sequences 0-2 have their history cached; sequence 3 is a new prompt
    # whose chunk 2 (after a cached chunk 1) is in the mixed step.
    run_step(model, kv, [(s, 0, history[s]) for s in range(3)] + [(3, 0, history[3][:15])], tables)
    step = [(0, 20, [7]), (3, 15, history[3][15:]), (1, 33, [99]), (2, 9, [3])]

    kv_mixed = [(k.clone(), v.clone()) for k, v in kv]
    mixed = run_step(model, kv_mixed, step, tables)
    for i, chunk in enumerate(step):
        kv_alone = [(k.clone(), v.clone()) for k, v in kv]
        alone = run_step(model, kv_alone, [chunk], tables)
        torch.testing.assert_close(mixed[i], alone[0], atol=1e-5, rtol=0)


def test_bfloat16_runs(hf_dir):
    model = load_model(hf_dir, torch.bfloat16, CPU)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    num_blocks, tables = shuffled_block_tables(2, blocks_per_seq=3, seed=7)
    kv = model.allocate_kv_caches(num_blocks, BLOCK_SIZE, torch.bfloat16, CPU)
    logits = run_step(model, kv, [(0, 0, list(range(30))), (1, 0, [5])], tables)
    logits = torch.cat([logits, run_step(model, kv, [(0, 30, [1]), (1, 1, [2, 3, 4])], tables)])
    assert logits.shape == (4, 512) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_load_weights_reports_missing_unexpected_and_misshapen(hf_model):
    ours = ours_from_hf(hf_model, pack=False)  # loaded again below
    state = dict(hf_model.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.9.extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\].*extra"):
        ours.load_weights(state.items())
    state = dict(hf_model.state_dict())
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    with pytest.raises(CheckpointError, match=r"k_proj.weight: shape \(16, 64\) in the checkpoint.*\(32, 64\)"):
        ours.load_weights(state.items())


def test_load_model_rejects_other_architectures(tmp_path):
    transformers.GPT2Config(n_embd=64, n_layer=1, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported architectures: Gemma"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_metadata_layout():
    table = torch.tensor([[4, 1, 7, -1], [2, 0, -1, -1], [3, -1, -1, -1]], dtype=torch.int32)
    meta = build_metadata(torch.tensor([1, 3, 1]), torch.tensor([9, 2, 0]), table, 4)
    assert meta.num_tokens == 5
    assert meta.positions.tolist() == [9, 2, 3, 4, 0]
    assert meta.slot_mapping.tolist() == [7 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 0 * 4 + 0, 3 * 4 + 0]

    dec = meta.decode
    assert dec.token_index.tolist() == [[0], [4]]
    assert dec.block_ids.tolist() == [[4, 1, 7], [3, 0, 0]]  # unused (-1) entries -> 0
    assert dec.mask.shape == (2, 1, 1, 12)
    assert dec.mask.sum(-1).flatten().tolist() == [10, 1]
    assert not dec.identity

    pre = meta.prefill
    assert pre.token_index.tolist() == [[1, 2, 3]]
    assert pre.block_ids.tolist() == [[2, 0]]
    assert pre.mask.shape == (1, 1, 3, 8)
    assert pre.mask.sum(-1).flatten().tolist() == [3, 4, 5]
    assert pre.out_tokens.tolist() == [1, 2, 3]


def test_paged_attention_matches_reference():
    """Padded prefill rows of different lengths plus decodes, GQA, against per-request attention."""
    gen = torch.Generator().manual_seed(8)
    heads, kv_heads, dim, block_size = 4, 2, 8, 4
    query_lens = torch.tensor([1, 6, 1, 2, 9])
    starts = torch.tensor([13, 0, 2, 7, 5])
    num_blocks, tables = shuffled_block_tables(5, blocks_per_seq=4, seed=9)
    table = torch.stack(tables)
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen)
    total = int(query_lens.sum())
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen)
    v = torch.randn(total, kv_heads, dim, generator=gen)
    meta = build_metadata(query_lens, starts, table, block_size)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=0.3)
    assert torch.isfinite(out).all()

    offset = 0
    for i in range(5):
        n, start = int(query_lens[i]), int(starts[i])
        slots = [int(table[i, p // block_size]) * block_size + p % block_size for p in range(start + n)]
        keys = k_cache[slots].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        values = v_cache[slots].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[offset : offset + n].transpose(0, 1), keys, values, attn_mask=mask, scale=0.3
        ).transpose(0, 1)
        torch.testing.assert_close(out[offset : offset + n], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(k_cache[slots[start:]], k[offset : offset + n], atol=0, rtol=0)
        offset += n


def test_metadata_rejects_bad_input():
    table = torch.zeros((2, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="query_len"):
        build_metadata(torch.tensor([1, 0]), torch.tensor([0, 0]), table, 16)
    with pytest.raises(ValueError, match="does not fit"):
        build_metadata(torch.tensor([1, 1]), torch.tensor([0, 32]), table, 16)
    with pytest.raises(ValueError, match="start_positions"):
        build_metadata(torch.tensor([1, 1]), torch.tensor([0]), table, 16)
