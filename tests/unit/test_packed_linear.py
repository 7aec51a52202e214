"""Linear weights packed once for oneDNN after loading: the same results, on the CPU only, in place."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformers

from pipeline.gpu_worker.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    linear,
    packed,
)
from pipeline.gpu_worker.models.loader import load_model
from tests.e2e.test_model import tiny_config

CPU = torch.device("cpu")
ROWS = [1, 5, 16, 64, 257]


def layers(bias: bool) -> list[LinearBase]:
    """One layer of each kind at sizes that are not multiples of oneDNN's blocks, weights random."""
    torch.manual_seed(0)
    made = [
        ReplicatedLinear(72, 40, bias),
        MergedColumnParallelLinear(72, [96, 96], bias),
        QKVParallelLinear(72, 12, 6, 2, bias),
        RowParallelLinear(200, 72, bias),
    ]
    with torch.no_grad():
        for layer in made:
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape))
    return made


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_gives_the_dense_result(bias):
    for layer in layers(bias):
        dense = layer.weight.detach().clone()
        b = None if layer.bias is None else layer.bias.detach().clone()
        layer.pack_weights()
        assert layer.weight.is_mkldnn and layer.weight.shape == dense.shape
        assert not layer.weight.requires_grad
        for m in ROWS:
            x = torch.randn(m, dense.shape[1])
            with torch.inference_mode():
                out = layer(x)
            exact = torch.nn.functional.linear(x.double(), dense.double(), None if b is None else b.double())
            assert out.shape == (m, dense.shape[0]) and out.dtype == torch.float32
            # float32 rounding of a dot product of `in` terms.
            torch.testing.assert_close(out.double(), exact, rtol=0, atol=2e-6 * dense.shape[1])
            torch.testing.assert_close(out, linear(x, dense, b), rtol=1e-6, atol=1e-5)


def test_bfloat16_packs_and_matches_dense():
    layer = layers(bias=True)[1].to(torch.bfloat16)
    dense, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack_weights()
    # oneDNN packs bfloat16 only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere the dense weight stays.
    assert layer.weight.is_mkldnn == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert layer.weight.dtype == torch.bfloat16
    for m in ROWS:
        x = torch.randn(m, dense.shape[1], dtype=torch.bfloat16)
        with torch.inference_mode():
            out = layer(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), torch.nn.functional.linear(x, dense, b).float(), rtol=2e-2, atol=0.5)


def test_packing_frees_the_dense_weight():
    layer = layers(bias=False)[1]
    dense = weakref.ref(layer.weight)
    layer.pack_weights()
    gc.collect()
    assert dense() is None
    assert layer.weight.numel() * layer.weight.element_size() == 192 * 72 * 4


def test_only_cpu_float32_and_bfloat16_weights_pack():
    assert packed(torch.randn(8, 16)).is_mkldnn
    assert packed(torch.empty(8, 16, device="meta")) is None  # any other device: CUDA weights stay dense
    assert packed(torch.randn(8, 16, dtype=torch.float16)) is None
    assert packed(torch.randn(8, 16, dtype=torch.float64)) is None


@pytest.mark.parametrize("tied", [False, True])
def test_load_model_packs_every_linear_weight_once(tmp_path, tied):
    torch.manual_seed(0)
    cfg = tiny_config(tie_word_embeddings=tied)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), torch.float32, CPU)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * cfg.num_hidden_layers
    assert all(m.weight.is_mkldnn for m in linears)
    # Every parameter once, packed or not: no weight is held twice.
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
    embed = model.model.embed_tokens
    if tied:  # the embedding's lookups keep the dense table; the head gets a packed copy beside it
        assert not embed.weight.is_mkldnn and embed.packed_weight.is_mkldnn
        assert [n for n, _ in model.named_buffers() if n.endswith("packed_weight")] == [
            "model.embed_tokens.packed_weight"
        ]
    else:
        assert not embed.weight.is_mkldnn and embed.packed_weight is None
        assert model.lm_head.weight.is_mkldnn and model.lm_head.packed_weight is None
    assert "model.embed_tokens.packed_weight" not in model.state_dict()
    ids = torch.tensor([[1, 7, 42, 299, 3]])
    with torch.inference_mode():
        want = hf(ids).logits[0]
        meta = model.attn_backend.build_from_rows(torch.tensor([5]), torch.tensor([0]), torch.arange(1)[None], 16)
        kv = model.allocate_kv_caches(1, 16, torch.float32, CPU)
        got = model.compute_logits(model(ids[0], meta.positions, meta, kv))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
