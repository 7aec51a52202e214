"""LoRA adapters on the model: each adapter's logits equal peft's merged model through transformers, and a
batch mixing adapters gives every row what it gets alone.

Tiny random Llama and Qwen2 (q/k/v biases) bases; adapters made with peft on
different target-module sets, ranks and scalings, with random B (peft starts
B at zero, which would hide every bug of the update).
"""

from __future__ import annotations

import json

import numpy as np
import peft
import pytest
import torch
import transformers

from pipeline.common.lora_checkpoint import LoraError, read_weights, save_weights
from pipeline.gpu_worker.lora.adapter import load_prepared, read_adapter
from pipeline.gpu_worker.lora.layers import LoraSlots
from pipeline.gpu_worker.models.loader import load_model
from tests.reference import NEAR_TIE

CPU = torch.device("cpu")
BLOCK = 16
STEPS = 6
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
}
# name -> (r, lora_alpha, use_rslora, target_modules)
ADAPTERS = {
    "all": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "attn-rs": (4, 8, True, ["q_proj", "v_proj", "o_proj"]),
    "mlp": (2, 4, False, ["up_proj", "down_proj"]),
}
MAX_RANK = 8


def make_base(cls, fields: dict, path) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**BASE, **fields}), attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)


def make_adapter(base_dir, out_dir, spec, seed: int):
    """Save a peft adapter of ``spec`` on the model in ``base_dir``; returns peft's merged model."""
    r, alpha, rslora, targets = spec
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(hf, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out_dir)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(base dir, transformers base, {adapter: (dir, merged model)})."""
    cls, fields = FAMILIES[request.param]
    base_dir = tmp_path_factory.mktemp(request.param)
    make_base(cls, fields, base_dir)
    adapters = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        d = tmp_path_factory.mktemp(f"{request.param}-{name}")
        adapters[name] = (d, make_adapter(base_dir, d, spec, seed=i + 1))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    return base_dir, hf.eval(), adapters


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, BASE["vocab_size"], (int(k),), generator=gen).tolist() for k in (21, 9, 30, 17)[:n]]


@torch.inference_mode()
def run_greedy(model, slots: LoraSlots, seqs: list[list[int]], row_slots: list[int]):
    """Prefill every prompt in one step, then decode ``STEPS`` greedy steps, all rows in every step.

    Returns each row's tokens (prompt and output) and its ``[STEPS, vocab]`` logits.
    """
    seqs = [list(s) for s in seqs]
    width = -(-(max(map(len, seqs)) + STEPS) // BLOCK)
    table = torch.arange(len(seqs) * width).view(len(seqs), width)
    kv = model.allocate_kv_caches(len(seqs) * width, BLOCK, torch.float32, CPU)
    done = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    for _ in range(STEPS):
        chunks = [s[done[i] :] for i, s in enumerate(seqs)]
        lens = torch.tensor([len(c) for c in chunks])
        slots.batch.set_rows(np.asarray(row_slots), lens.numpy(), CPU)
        meta = model.attn_backend.build_from_rows(lens, torch.tensor(done), table, BLOCK)
        hidden = model(torch.tensor([t for c in chunks for t in c]), meta.positions, meta, kv)
        rows = model.compute_logits(hidden[torch.cumsum(lens, 0) - 1])
        for i, s in enumerate(seqs):
            done[i] = len(s)
            logits[i].append(rows[i])
            s.append(int(rows[i].argmax()))
    return seqs, [torch.stack(x) for x in logits]


@torch.inference_mode()
def check_reference(hf, seq: list[int], prompt_len: int, ours: torch.Tensor) -> None:
    ref = hf(torch.tensor([seq])).logits[0, prompt_len - 1 : -1]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    for token, row in zip(seq[prompt_len:], ref, strict=True):
        best = int(row.argmax())
        assert token == best or float(row[best] - row[token]) < NEAR_TIE


def served(base_dir, adapters, names, max_loras: int):
    model = load_model(base_dir, torch.float32, CPU)
    slots = LoraSlots(model, max_loras=max_loras, max_rank=MAX_RANK)
    for slot, name in enumerate(names, start=1):
        slots.load(slot, read_adapter(adapters[name][0], model.config, MAX_RANK))
    return model, slots


def test_each_adapter_matches_peft_merged_model(family):
    base_dir, _, adapters = family
    model, slots = served(base_dir, adapters, list(ADAPTERS), max_loras=len(ADAPTERS))
    seqs = prompts(len(ADAPTERS))
    row_slots = list(range(1, len(ADAPTERS) + 1))
    out, logits = run_greedy(model, slots, seqs[: len(row_slots)], row_slots)
    for name, seq, prompt, lg in zip(ADAPTERS, out, seqs, logits, strict=False):
        check_reference(adapters[name][1], seq, len(prompt), lg)


def test_mixed_batch_gives_each_row_its_solo_output(family):
    """Rows (base, A, B, A) in one batch: each row's tokens and logits are those it gets alone, and equal
    the reference model's."""
    base_dir, hf, adapters = family
    model, slots = served(base_dir, adapters, ["all", "attn-rs"], max_loras=3)
    seqs = prompts(4)
    row_slots = [0, 1, 2, 1]
    refs = [hf, adapters["all"][1], adapters["attn-rs"][1], adapters["all"][1]]
    mixed, mixed_logits = run_greedy(model, slots, seqs, row_slots)
    for i, (seq, prompt) in enumerate(zip(seqs, mixed, strict=True)):
        solo, solo_logits = run_greedy(model, slots, [seq], [row_slots[i]])
        assert solo[0] == prompt
        torch.testing.assert_close(solo_logits[0], mixed_logits[i], atol=1e-4, rtol=0)  # batch shapes round apart
        check_reference(refs[i], prompt, len(seq), mixed_logits[i])


def test_reloading_a_slot_replaces_its_adapter(family):
    base_dir, hf, adapters = family
    model, slots = served(base_dir, adapters, ["all"], max_loras=1)
    slots.load(1, read_adapter(adapters["mlp"][0], model.config, MAX_RANK))
    seq = prompts(1)
    out, logits = run_greedy(model, slots, seq, [1])
    check_reference(adapters["mlp"][1], out[0], len(seq[0]), logits[0])
    slots.load(1, None)
    out, logits = run_greedy(model, slots, seq, [1])
    check_reference(hf, out[0], len(seq[0]), logits[0])


def _sharded_logits(rank: int, size: int, base_dir: str, adapters: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    from pipeline.gpu_worker.layers.tp import TPGroup

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=size)
    model = load_model(base_dir, torch.float32, CPU, tp=TPGroup(rank, size, dist.group.WORLD))
    slots = LoraSlots(model, max_loras=len(adapters), max_rank=MAX_RANK)
    for slot, d in enumerate(adapters, start=1):
        slots.load(slot, read_adapter(d, model.config, MAX_RANK))
    torch.save(run_greedy(model, slots, prompts(3), [0, 1, 2]), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_two_tensor_parallel_ranks_give_the_single_rank_outputs(family, tmp_path):
    """Each rank holds its rows of B (q/k/v, gate/up) or columns of A (o, down, summed over the ranks)."""
    import torch.multiprocessing as mp

    base_dir, _, adapters = family
    model, slots = served(base_dir, adapters, ["all", "attn-rs"], max_loras=2)
    want_tokens, want_logits = run_greedy(model, slots, prompts(3), [0, 1, 2])
    dirs = [str(adapters[n][0]) for n in ("all", "attn-rs")]
    mp.spawn(_sharded_logits, args=(2, str(base_dir), dirs, str(tmp_path)), nprocs=2)
    for rank in range(2):
        tokens, logits = torch.load(tmp_path / f"rank{rank}.pt")
        assert tokens == want_tokens
        for got, want in zip(logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def rewrite_config(d, **changes):
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))


def test_bad_adapters_are_refused_naming_the_cause(family, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    base_dir, _, adapters = family
    config = load_model(base_dir, torch.float32, CPU).config
    src = adapters["all"][0]
    with pytest.raises(LoraError, match="rank 8 is over --max-lora-rank 4"):
        read_adapter(src, config, 4)
    with pytest.raises(LoraError, match="not a PEFT LoRA adapter"):
        read_adapter(tmp_path, config, MAX_RANK)

    bad = tmp_path / "unknown"
    shutil.copytree(src, bad)
    rewrite_config(bad, target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoraError, match=r"target modules \['lm_head'\] are not served"):
        read_adapter(bad, config, MAX_RANK)

    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    tensors = load_file(missing / "adapter_model.safetensors")
    del tensors[next(k for k in tensors if "layers.1.mlp.down_proj.lora_B" in k)]
    save_file(tensors, missing / "adapter_model.safetensors")
    with pytest.raises(LoraError, match=r"lacks tensors of its target modules: layers\.1\.down_proj\.lora_B"):
        read_adapter(missing, config, MAX_RANK)

    other = tmp_path / "other-base"
    shutil.copytree(src, other)
    tensors = load_file(other / "adapter_model.safetensors")
    tensors = {k: torch.zeros(v.shape[0], 32) if ".lora_A." in k else v for k, v in tensors.items()}
    save_file(tensors, other / "adapter_model.safetensors")
    with pytest.raises(LoraError, match=r"trained for another base model"):
        read_adapter(other, config, MAX_RANK)


def test_the_prepared_copy_holds_what_was_read_and_bfloat16_is_widened(family, tmp_path):
    """The worker's copy (float32, B scaled) reads back equal; a bfloat16 checkpoint reads as its float32
    widening; a NaN is refused naming the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    base_dir, _, adapters = family
    config = load_model(base_dir, torch.float32, CPU).config
    src = adapters["attn-rs"][0]
    read = read_adapter(src, config, MAX_RANK)
    save_weights(read_weights(src, config, MAX_RANK), tmp_path / "copy.safetensors")
    copy = load_prepared(tmp_path / "copy.safetensors")
    assert copy.weights.keys() == read.weights.keys()
    for key, (a, b) in read.weights.items():
        assert torch.equal(copy.weights[key][0], a) and torch.equal(copy.weights[key][1], b)

    half = tmp_path / "bf16"
    shutil.copytree(src, half)
    tensors = load_file(half / "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, half / "adapter_model.safetensors")
    widened = read_adapter(half, config, MAX_RANK)
    for key, (a, b) in read.weights.items():
        torch.testing.assert_close(widened.weights[key][0], a.to(torch.bfloat16).float(), atol=0, rtol=0)
        torch.testing.assert_close(widened.weights[key][1], b, atol=0, rtol=1e-2)

    nan = tmp_path / "nan"
    shutil.copytree(src, nan)
    name = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_A" in k)
    save_file({**tensors, name: torch.full_like(tensors[name], float("nan"))}, nan / "adapter_model.safetensors")
    with pytest.raises(LoraError, match=r"tensor .*layers\.0\.self_attn\.q_proj\.lora_A.* holds NaN"):
        read_adapter(nan, config, MAX_RANK)
