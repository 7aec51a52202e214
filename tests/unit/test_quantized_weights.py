"""Weight-only quantized linear weights: each format's dequantization against its reference, each kernel against
``x @ dequant(W).T``, tiny models per format against the same model in float, and the start-up refusals."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import transformers
from gguf import GGMLQuantizationType as GGML
from safetensors.torch import save_file

from pipeline.common.config import QuantizationConfig
from pipeline.common.gguf_layout import hf_name
from pipeline.common.model_files import default_model_path, read_model_config, resolve_quantization
from pipeline.gpu_worker.layers import quant, quant_cpu
from pipeline.gpu_worker.layers.linear import LinearBase, ReplicatedLinear
from pipeline.gpu_worker.layers.quant import QuantizedWeight, dequantize, quantize_rtn
from pipeline.gpu_worker.layers.tp import TPGroup
from pipeline.gpu_worker.models.base import CheckpointError
from pipeline.gpu_worker.models.gguf_index import read_tensors
from pipeline.gpu_worker.models.gguf_loader import decode
from pipeline.gpu_worker.models.loader import load_model
from tests.e2e.test_model import BLOCK_SIZE, run_step, shuffled_block_tables, tiny_config

CPU = torch.device("cpu")


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (4, 128), (8, 32), (8, 256)])
def test_round_to_nearest_is_within_half_a_step(bits, group):
    torch.manual_seed(0)
    w = torch.randn(48, 256) * 0.05
    codes, scale, zero = quantize_rtn(w, bits, group)
    assert codes.dtype == (torch.uint8 if bits == 4 else torch.int8) and scale.shape == (48, 256 // group)
    assert (zero is None) == (bits == 8)
    lo, hi = (0, 15) if bits == 4 else (-128, 127)
    assert lo <= int(codes.min()) and int(codes.max()) <= hi
    step = scale.repeat_interleave(group, dim=1)
    assert bool(((dequantize(codes, scale, zero) - w).abs() <= step / 2 + 1e-6).all())


# Where the compiled CPU kernel builds, pack chooses it for every weight these tests make.
PANEL = quant_cpu.unavailable_reason() is None
needs_panel = pytest.mark.skipif(not PANEL, reason=f"quant_cpu kernel unavailable: {quant_cpu.unavailable_reason()}")


@contextlib.contextmanager
def torch_kernels():
    """Weights packed meanwhile run torch's weight-only ops (or the dequantizing fallback), not quant_cpu's."""
    saved, quant.CPU_KERNEL = quant.CPU_KERNEL, False
    try:
        yield
    finally:
        quant.CPU_KERNEL = saved


# (bits, group, dtype, panel) -> the kernel that runs and the tolerance of its result against x @ dequant(W).T
# in float64, relative to the result's largest magnitude: torch's weight-only kernels round the activations,
# the scales and the output to bfloat16 (8 significant bits) whatever the dtype; the dequantizing fallback is
# a matmul in the activation dtype; the panel kernel computes in float32 and rounds the output to the
# activation dtype.
BF16 = 1e-2
KERNELS = [
    (4, 32, torch.float32, False, "int4_cpu", BF16),
    (4, 128, torch.float32, False, "int4_cpu", BF16),
    (4, 128, torch.bfloat16, False, "int4_cpu", BF16),
    (8, None, torch.float32, False, "int8", BF16),
    (8, None, torch.bfloat16, False, "int8", BF16),
    (8, 32, torch.float32, False, "dequantize", 1e-5),
    (4, 48, torch.float32, False, "dequantize", 1e-5),
    (4, 48, torch.bfloat16, False, "dequantize", BF16),
    pytest.param(4, 32, torch.float32, True, "int4_panel", 1e-5, marks=needs_panel),
    pytest.param(4, 48, torch.bfloat16, True, "int4_panel", BF16, marks=needs_panel),
    pytest.param(8, None, torch.float32, True, "int8_panel", 1e-5, marks=needs_panel),
    pytest.param(8, 32, torch.bfloat16, True, "int8_panel", BF16, marks=needs_panel),
]


@pytest.mark.parametrize(("bits", "group", "dtype", "panel", "kernel", "tol"), KERNELS)
def test_each_kernel_multiplies_by_the_dequantized_weight(bits, group, dtype, panel, kernel, tol):
    torch.manual_seed(1)
    w = torch.randn(96, 384) * 0.05
    codes, scale, zero = quantize_rtn(w, bits, group or 384)
    with contextlib.nullcontext() if panel else torch_kernels():
        weight = QuantizedWeight.pack(codes, scale, zero)
    assert weight.kernel == kernel and weight.shape == (96, 384)
    exact_w = dequantize(codes, scale, zero, torch.float64)
    for rows in (1, 7, 33):
        x = torch.randn(rows, 384).to(dtype)
        with torch.inference_mode():
            y = weight(x)
        assert y.shape == (rows, 96) and y.dtype == dtype
        exact = x.double() @ exact_w.T
        assert float((y.double() - exact).abs().max()) <= tol * float(exact.abs().max())
    # Each weight as the kernel sees it: torch's round scale and zero to bfloat16, then the weight (each a
    # relative 2^-9), so the error is bounded by (|w| + 8 |scale| + |zero|) 2^-8 in its group; the others
    # round in float32 (2^-24 each).
    terms = 8 * scale.double().abs() + (0 if zero is None else zero.double().abs())
    unit = 2**-8 if kernel in ("int4_cpu", "int8") else 2**-22
    bound = (exact_w.abs() + terms.repeat_interleave(exact_w.shape[1] // scale.shape[1], dim=1)) * unit
    assert bool(((weight.dequantized(torch.float64) - exact_w).abs() <= bound).all())


@needs_panel
@pytest.mark.parametrize(
    ("bits", "group", "out", "inp"),
    [(4, 32, 48, 96), (4, 64, 960, 576), (4, 128, 32, 1280), (8, 32, 16, 320), (8, None, 80, 576)],
)
def test_the_panel_kernel_is_exact_to_float32_rounding_for_every_batch_tail(bits, group, out, inp):
    """Output widths of odd tile counts, input widths past one panel and not a multiple of it, and every row count
    up to two micro-kernel blocks (plus a serving batch): x @ dequant(W).T within 1e-5 of its largest magnitude."""
    torch.manual_seed(2)
    codes, scale, zero = quantize_rtn(torch.randn(out, inp), bits, group or inp)
    weight = QuantizedWeight.pack(codes, scale, zero)
    assert weight.kernel == f"int{bits}_panel"
    exact_w = dequantize(codes, scale, zero, torch.float64)
    x = torch.randn(64, inp)
    for rows in [*range(1, 26), 64]:
        y = weight(x[:rows])
        exact = x[:rows].double() @ exact_w.T
        assert float((y.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max()), rows


VNNI = quant_cpu.vnni_unavailable_reason() is None
needs_vnni = pytest.mark.skipif(not VNNI, reason=f"no int8-activation kernel: {quant_cpu.vnni_unavailable_reason()}")


def rounded_as_the_vnni_kernel_rounds(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x [M, K]`` as ``quant_linear_vnni`` sees it: per row and block of columns, int8 steps of max |x| / 127."""
    xb = x.float().reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    # 127 / amax, as the kernel divides (torch's 127 / t is 127 * (1 / t), rounded twice).
    q = (xb * torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)).round()
    return (q * (amax / 127)).reshape(x.shape)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("bits", "group", "with_zero", "out", "inp"),
    [
        (4, 32, True, 48, 96),
        (4, 128, True, 80, 1280),
        (8, None, False, 80, 576),
        (8, 32, False, 16, 320),
        (8, 16, True, 48, 256),
    ],
)
def test_the_vnni_kernel_multiplies_int8_rounded_activations_to_float32_rounding(
    bits, group, with_zero, out, inp, dtype
):
    """Weights of a bfloat16 model pack for it; odd tile counts, int8 with a zero, and every row count up to two
    micro-kernel blocks (plus a serving batch): the activations rounded as the kernel rounds them, times
    dequant(W).T, within float32 rounding (and the output's rounding to bfloat16)."""
    torch.manual_seed(3)
    codes, scale, zero = quantize_rtn(torch.randn(out, inp), bits, group or inp)
    if with_zero and zero is None:
        zero = 0.1 * torch.randn_like(scale)
    weight = QuantizedWeight.pack(codes, scale, zero, torch.bfloat16)
    assert weight.kernel == f"int{bits}_vnni"
    exact_w = dequantize(codes, scale, zero, torch.float64)
    x = torch.randn(64, inp).to(dtype)
    for rows in [*range(1, 14), 64]:
        y = weight(x[:rows])
        assert y.dtype == dtype
        exact = rounded_as_the_vnni_kernel_rounds(x[:rows], weight.block_size).double() @ exact_w.T
        out_rounding = 2**-8 * exact.abs() if dtype == torch.bfloat16 else 0
        bound = out_rounding + 1e-5 * float(exact.abs().max())
        assert bool(((y.double() - exact).abs() <= bound).all()), rows


def test_a_float32_model_keeps_the_float32_kernels():
    codes, scale, zero = quantize_rtn(torch.randn(32, 64), 4, 32)
    assert QuantizedWeight.pack(codes, scale, zero).kernel == ("int4_panel" if PANEL else "int4_cpu")


def test_the_panel_kernel_leaves_an_output_width_not_a_multiple_of_16_to_torch():
    codes, scale, zero = quantize_rtn(torch.randn(40, 64), 8, 64)
    assert QuantizedWeight.pack(codes, scale, zero).kernel == "int8"


K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, magnitude: float) -> np.ndarray:
    """``[rows, cols / 256 * block bytes]`` uint8 of random K-quant super-blocks: any bytes are a valid block
    once its f16 ``d`` (and ``dmin``) are finite; these are drawn of either sign, so that the weights
    centre on 0, and sized so that they reach about ``magnitude``."""
    qtype = GGML[kind]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, block_bytes), dtype=np.uint8)
    # The largest |d sc q| of a block: 6-bit scales times 4-, 5-bit codes; Q6_K's int8 scales times q - 32.
    largest = {"Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 128 * 32}[kind]
    d_offsets = [208] if kind == "Q6_K" else [0, 2]
    for offset in d_offsets:
        d = rng.uniform(-1, 1, raw.shape[:2]) * magnitude / largest
        raw[..., offset : offset + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", *K_QUANTS])
def test_gguf_blocks_decode_to_gguf_dequantize(kind):
    rng = np.random.default_rng(2)
    qtype = GGML[kind]
    if kind in K_QUANTS:
        raw = random_blocks(kind, 24, 512, rng, magnitude=4.0)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((24, 512)).astype(np.float32), qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    codes, scale, zero = decode(kind, torch.from_numpy(raw))
    group = {"Q6_K": 16}.get(kind, 32)
    assert codes.shape == (24, 512) and scale.shape == (24, 512 // group)
    assert codes.dtype == (torch.uint8 if kind in ("Q4_0", "Q4_1", "Q4_K") else torch.int8)
    assert (zero is None) == (kind in ("Q8_0", "Q6_K"))
    ours = dequantize(codes, scale, zero)
    if kind in ("Q4_1", "Q4_K"):
        # (q - 8) d + (m + 8 d) against d q + m: the rounding of two float32 sums of terms of |m| + 15 |d|.
        bound = (zero.abs() + 8 * scale.abs()).repeat_interleave(32, dim=1) * 2**-22
        assert bool(((ours - reference).abs() <= bound).all())
    else:
        assert torch.equal(ours, reference)


# Tiny models, per format: the quantized model's greedy tokens equal those of the same model with its
# linear weights replaced by their dequantized values in float32; its logits, to float rounding.
GGUF_NAMES = {hf_name(n): n for n in ["token_embd.weight", "output_norm.weight", "output.weight"]} | {
    hf_name(f"blk.{i}.{part}.weight"): f"blk.{i}.{part}.weight"
    for i in range(2)
    for part in ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-float")
    config = tiny_config(tie_word_embeddings=True, initializer_range=0.2)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def _is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def _write_float(model_dir: Path, out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir()
    shutil.copy(model_dir / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    return out


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's rotary permutation of a query or key projection's rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    float_dir: Path, path: Path, kind: str, linear_kinds: dict[str, str] | None = None, head_kind: str | None = None
) -> Path:
    """The float checkpoint as a GGUF file, linear weights as ``kind`` (or ``linear_kinds[gguf name]``), the LM
    head's table (``output.weight``, else the tied ``token_embd.weight``) as ``head_kind`` (None: float);
    returns the float directory of the same weights as llama.cpp would dequantize them.

    gguf-py has no K-quant quantizer: their weights are random blocks (``random_blocks``) of about the
    float weights' magnitude instead."""
    rng = np.random.default_rng(5)
    config = json.loads((float_dir / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    writer = gguf.GGUFWriter(path, "llama")
    dequantized = {}
    tensors = _state_dict(float_dir)
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    for name, tensor in tensors.items():
        gname = GGUF_NAMES[name]
        data = tensor.numpy()
        if not (_is_linear(name) or (name == head and head_kind)):
            writer.add_tensor(gname, data)
            dequantized[name] = tensor
            continue
        n_heads = heads.get(gname.split(".")[2]) if gname.startswith("blk.") else None
        if n_heads is not None:
            data = _permute(data, n_heads)
        qtype = GGML[head_kind if name == head else (linear_kinds or {}).get(gname, kind)]
        if qtype.name in K_QUANTS:
            raw = random_blocks(qtype.name, *data.shape, rng, magnitude=float(np.abs(data).max()))
        else:
            raw = gguf.quants.quantize(data, qtype)
        writer.add_tensor(gname, raw, raw_dtype=qtype)
        back = gguf.quants.dequantize(raw, qtype)
        if n_heads is not None:  # transformers' reverse_permute
            back = back.reshape(n_heads, back.shape[0] // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(back.shape)
        dequantized[name] = torch.from_numpy(np.ascontiguousarray(back))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return _write_float(float_dir, path.with_suffix(".float"), dequantized)


def rtn_float_dir(float_dir: Path, out: Path, bits: int, group: int | None) -> Path:
    """The float checkpoint with its linear weights replaced by their round-to-nearest dequantization."""
    tensors = _state_dict(float_dir)
    for name, w in tensors.items():
        if _is_linear(name):
            tensors[name] = dequantize(*quantize_rtn(w, bits, group or w.shape[1]))
    return _write_float(float_dir, out, tensors)


def greedy(
    model, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype = torch.float32
) -> tuple[list[list[int]], torch.Tensor]:
    """Each prompt's greedy continuation (prefill, then one token a step), and the first step's logits."""
    num_blocks, tables = shuffled_block_tables(len(prompts), blocks_per_seq=3, seed=4)
    kv = model.allocate_kv_caches(num_blocks, BLOCK_SIZE, dtype, CPU)
    tokens = [list(p) for p in prompts]
    first = run_step(model, kv, [(i, 0, p) for i, p in enumerate(prompts)], tables)
    for seq, row in enumerate(first):
        tokens[seq].append(int(row.argmax()))
    for _ in range(new_tokens - 1):
        chunks = [(seq, len(t) - 1, t[-1:]) for seq, t in enumerate(tokens)]
        for seq, row in enumerate(run_step(model, kv, chunks, tables)):
            tokens[seq].append(int(row.argmax()))
    return tokens, first


# Each layer of the model and the checkpoint tensors it fuses, in order.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def assert_head_held(model) -> None:
    """The LM head multiplies by its codes on the panel kernel, or, where that is not built, by the dense table
    they dequantize to (no other kernel takes group-wise int8)."""
    head = model.lm_head.weight
    if PANEL:
        assert isinstance(head, QuantizedWeight) and head.kernel == "int8_panel"
    else:
        assert not isinstance(head, QuantizedWeight) and head.dtype == torch.float32


def assert_weights_equal(model, reference_dir: Path) -> None:
    """Each quantized layer's weight (and a quantized LM head's), as its kernel holds it, equals the float weights
    of ``reference_dir`` to float32 rounding (the model was packed under ``exact_kernels``)."""
    reference = _state_dict(reference_dir)
    for name, m in model.named_modules():
        if not isinstance(getattr(m, "weight", None), QuantizedWeight):
            continue
        if name == "lm_head":
            expected = reference.get("lm_head.weight", reference["model.embed_tokens.weight"])
        else:
            block, layer = name.split(".")[:3], ".".join(name.split(".")[3:])
            expected = torch.cat([reference[".".join([*block, part, "weight"])] for part in FUSED[layer]])
        atol = 2**-20 * float(expected.abs().max())
        torch.testing.assert_close(m.weight.dequantized(torch.float32), expected, rtol=0, atol=atol, msg=name)


@contextlib.contextmanager
def exact_kernels():
    """Weights packed meanwhile run their weight-only kernels in float32 (to float32 rounding)."""
    saved, quant.KERNEL_DTYPE = quant.KERNEL_DTYPE, torch.float32
    try:
        yield
    finally:
        quant.KERNEL_DTYPE = saved


PROMPTS = [[5, 77, 300, 2, 41], [400, 12, 9, 9, 250, 131, 7, 60]]
FORMATS = {
    # name -> (QuantizationConfig fields, GGUF type or (bits, group) of round-to-nearest, the kernel where
    # quant_cpu's builds, the kernel where it does not)
    "int4 g32": ({"method": "int4", "group_size": 32}, (4, 32), "int4_panel", "int4_cpu"),
    "int4 g64": ({"method": "int4", "group_size": 64}, (4, 64), "int4_panel", "int4_cpu"),
    "int8 per-channel": ({"method": "int8"}, (8, None), "int8_panel", "int8"),
    "int8 g32": ({"method": "int8", "group_size": 32}, (8, 32), "int8_panel", "dequantize"),
    "gguf Q4_0": ({"method": "gguf"}, "Q4_0", "int4_panel", "int4_cpu"),
    "gguf Q4_1": ({"method": "gguf"}, "Q4_1", "int4_panel", "int4_cpu"),
    "gguf Q8_0": ({"method": "gguf"}, "Q8_0", "int8_panel", "dequantize"),
    "gguf Q4_K": ({"method": "gguf"}, "Q4_K", "int4_panel", "int4_cpu"),
    "gguf Q5_K": ({"method": "gguf"}, "Q5_K", "dequantize", "dequantize"),
    "gguf Q6_K": ({"method": "gguf"}, "Q6_K", "int8_panel", "dequantize"),
    # llama.cpp's Q4_K_M: Q6_K values and down projections beside Q4_K; the fused qkv layer holds int8 with a
    # zero in groups of 16, which both fit.
    "gguf Q4_K_M": (
        {"method": "gguf"},
        "Q4_K_M",
        {"dequantize", "int4_panel", "int8_panel"},
        {"dequantize", "int4_cpu"},
    ),
}
Q4_K_M = {f"blk.{i}.{part}.weight": "Q6_K" for i in range(2) for part in ("attn_v", "ffn_down")}


@pytest.fixture(scope="module")
def float_dir_256(tmp_path_factory) -> Path:
    """A tiny model whose linear layers' input widths are multiples of 256, the K-quants' super-block."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-float-256")
    config = tiny_config(hidden_size=256, intermediate_size=512, tie_word_embeddings=True, initializer_range=0.2)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def format_dirs(fmt: str, request, tmp_path: Path) -> tuple[Path, Path, dict]:
    """``FORMATS[fmt]``'s float model (input widths of 256 for the K-quants), the float directory of its weights
    as the format dequantizes them, and the ``QuantizationConfig`` fields that load it quantized."""
    fields, source, *_ = FORMATS[fmt]
    float_dir = request.getfixturevalue("float_dir_256" if "_K" in fmt else "float_dir")
    if isinstance(source, str):
        kinds = Q4_K_M if source == "Q4_K_M" else None
        # The tied table as SmolLM2's Q4_1 file holds it (Q8_0), or as llama.cpp's Q4_K_M files hold the head (Q6_K).
        head = "Q6_K" if "_K" in fmt else "Q8_0"
        reference_dir = write_gguf(float_dir, tmp_path / "m.gguf", "Q4_K" if kinds else source, kinds, head)
        return float_dir, reference_dir, {**fields, "gguf_file": str(tmp_path / "m.gguf")}
    return float_dir, rtn_float_dir(float_dir, tmp_path / "rtn", *source), fields


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_tiny_model_decodes_as_its_dequantized_float_twin(fmt, request, tmp_path):
    _, _, panel_kernel, torch_kernel = FORMATS[fmt]
    kernel = panel_kernel if PANEL else torch_kernel
    float_dir, reference_dir, fields = format_dirs(fmt, request, tmp_path)
    quant = QuantizationConfig(**fields)
    reference = load_model(reference_dir, torch.float32, CPU)
    theirs, their_logits = greedy(reference, PROMPTS, 12)
    # The kernels in float32: the same tokens, logits to float32 rounding.
    with exact_kernels():
        model = load_model(float_dir, torch.float32, CPU, quantization=quant)
    linears = [m for m in model.modules() if isinstance(m, LinearBase) and not isinstance(m, ReplicatedLinear)]
    assert len(linears) == 8 and all(isinstance(m.weight, QuantizedWeight) for m in linears)
    assert {m.weight.kernel for m in linears} == ({kernel} if isinstance(kernel, str) else kernel)
    if fields["method"] == "gguf":  # the head as the file holds it: symmetric int8 in groups of 32 (16 for Q6_K)
        assert_head_held(model)
    else:
        assert model.lm_head is None
    assert_weights_equal(model, reference_dir)
    ours, ours_logits = greedy(model, PROMPTS, 12)
    assert ours == theirs
    torch.testing.assert_close(ours_logits, their_logits, rtol=0, atol=1e-4)
    # As served (torch's kernels in bfloat16, where they run: the random model's logits are too flat for the
    # same tokens): the logits of the prompts within 3 % of their largest magnitude.
    served = load_model(float_dir, torch.float32, CPU, quantization=quant)
    _, served_logits = greedy(served, PROMPTS, 1)
    assert float((served_logits - their_logits).abs().max()) <= 0.03 * float(their_logits.abs().max())


def test_an_untied_gguf_head_is_multiplied_as_the_file_holds_it(tmp_path):
    torch.manual_seed(1)
    float_dir = tmp_path / "untied"
    transformers.LlamaForCausalLM(tiny_config(tie_word_embeddings=False, initializer_range=0.2)).save_pretrained(
        float_dir
    )
    reference_dir = write_gguf(float_dir, tmp_path / "m.gguf", "Q4_1", head_kind="Q8_0")
    theirs, their_logits = greedy(load_model(reference_dir, torch.float32, CPU), PROMPTS, 12)
    with exact_kernels():
        model = load_model(
            float_dir, torch.float32, CPU, quantization=QuantizationConfig("gguf", gguf_file=str(tmp_path / "m.gguf"))
        )
    assert_head_held(model)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert_weights_equal(model, reference_dir)
    ours, ours_logits = greedy(model, PROMPTS, 12)
    assert ours == theirs
    torch.testing.assert_close(ours_logits, their_logits, rtol=0, atol=1e-4)


@needs_vnni
@pytest.mark.parametrize("fmt", ["int4 g64", "int8 per-channel", "gguf Q4_1", "gguf Q5_K", "gguf Q4_K_M"])
def test_a_bfloat16_model_runs_every_quantized_layer_on_int8_activations(fmt, request, tmp_path):
    """In bfloat16 every layer, int8 with a zero too (Q5_K, Q4_K_M's mixed layers), takes the int8-activation
    kernel. Against the dequantized twin in float32, the RMS of its logits' error is within 5 % of the logits' RMS
    (measured: 2.2-4.0 %, where the twin run in bfloat16 is off by 1.4-2.6 %: the rounding of the activations to
    int8 adds to bfloat16's)."""
    float_dir, reference_dir, fields = format_dirs(fmt, request, tmp_path)
    _, exact = greedy(load_model(reference_dir, torch.float32, CPU), PROMPTS, 1)
    model = load_model(float_dir, torch.bfloat16, CPU, quantization=QuantizationConfig(**fields))
    linears = [m for m in model.modules() if isinstance(m, LinearBase) and not isinstance(m, ReplicatedLinear)]
    assert {m.weight.kernel for m in linears} <= {"int4_vnni", "int8_vnni"}
    _, ours = greedy(model, PROMPTS, 1, torch.bfloat16)
    assert float((ours.float() - exact).pow(2).mean().sqrt()) <= 0.05 * float(exact.pow(2).mean().sqrt())


def test_a_group_size_that_does_not_divide_a_layer_is_refused_naming_it(float_dir):
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.qkv_proj: .*group size 48 .*width 64"):
        load_model(float_dir, torch.float32, CPU, quantization=QuantizationConfig("int4", group_size=48))


def test_a_truncated_gguf_file_is_refused_naming_it(float_dir, tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(float_dir, path, "Q4_1")
    data = path.read_bytes()
    path.with_name("whole.gguf").write_bytes(data)
    path.write_bytes(data[: len(data) - 100])
    name = read_tensors(path.with_name("whole.gguf"))[-1].name
    with pytest.raises(
        CheckpointError,
        match=rf"^m\.gguf: not a readable GGUF file, truncated or corrupt \(tensor {re.escape(name)}'s data ends",
    ):
        load_model(float_dir, torch.float32, CPU, quantization=QuantizationConfig("gguf", gguf_file=str(path)))


@pytest.mark.parametrize("source", ["gguf Q4_1", "gguf Q4_K_M", "SmolLM2"])
def test_the_gguf_index_reads_what_gguf_py_reads(source, request, tmp_path):
    """Names, types, shapes and data of every tensor, against gguf-py's reader (which also parses the metadata:
    SmolLM2's file holds the tokenizer's arrays of strings and numbers)."""
    if source == "SmolLM2":
        path = default_model_path()
    else:
        path = Path(format_dirs(source, request, tmp_path)[2]["gguf_file"])
    ours, theirs = read_tensors(path), gguf.GGUFReader(path).tensors
    assert [(t.name, t.tensor_type, t.shape) for t in ours] == [
        (t.name, t.tensor_type, tuple(t.shape.tolist())) for t in theirs
    ]
    for a, b in zip(ours, theirs):
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def test_a_gguf_type_not_kept_quantized_is_refused_naming_the_tensor(float_dir, tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    # One Q2_K super-block (84 bytes, 256 weights) per row: the bytes are never read.
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((64, 84), np.uint8), raw_dtype=GGML.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"tensor blk\.0\.ffn_down\.weight is Q2_K.*--quantization none"):
        load_model(float_dir, torch.float32, CPU, quantization=QuantizationConfig("gguf", gguf_file=str(path)))


def test_gguf_layers_of_one_fused_projection_in_different_types_share_a_layout_both_fit(float_dir, tmp_path):
    # Q4_1 queries and values, Q8_0 keys: int8 codes with a zero (Q4_1's codes less 8) in groups of 32.
    path = tmp_path / "m.gguf"
    reference_dir = write_gguf(float_dir, path, "Q4_1", {"blk.0.attn_k.weight": "Q8_0"})
    with exact_kernels():
        model = load_model(float_dir, torch.float32, CPU, quantization=QuantizationConfig("gguf", gguf_file=str(path)))
    qkv = [m for n, m in model.named_modules() if n.endswith("qkv_proj")]
    assert [(m.weight.bits, m.weight.group_size, m.weight.kernel) for m in qkv] == [
        (8, 32, "dequantize"),
        (4, 32, "int4_panel" if PANEL else "int4_cpu"),
    ]
    assert_weights_equal(model, reference_dir)


def test_auto_keeps_a_llama_gguf_quantized_and_a_float_checkpoint_float(float_dir, tmp_path):
    config = read_model_config(float_dir)
    gguf_file = tmp_path / "m.gguf"
    assert resolve_quantization("auto", None, str(gguf_file), float_dir, config) == QuantizationConfig(
        "gguf", gguf_file=str(gguf_file.resolve())
    )
    assert resolve_quantization("none", None, str(gguf_file), float_dir, config) == QuantizationConfig()
    assert resolve_quantization("auto", None, str(float_dir), float_dir, config) == QuantizationConfig()
    assert resolve_quantization("int4", 64, str(float_dir), float_dir, config) == QuantizationConfig("int4", 64)
    with pytest.raises(ValueError, match="--quantization-group-size takes a positive size"):
        resolve_quantization("auto", 64, str(float_dir), float_dir, config)


def _sharded_greedy(rank: int, size: int, loads: list[tuple[str, QuantizationConfig]], out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=size)
    tp = TPGroup(rank, size, dist.group.WORLD)
    with exact_kernels():
        models = [load_model(model_dir, torch.float32, CPU, tp=tp, quantization=q) for model_dir, q in loads]
    results = [greedy(model, PROMPTS, 8) for model in models]
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_two_tensor_parallel_ranks_decode_as_one(float_dir, tmp_path):
    """Codes and group scales are sharded from full tensors: two gloo ranks give one rank's greedy tokens,
    for int4 quantized at load time, GGUF Q4_1 (its tied head Q8_0, split by vocabulary rows), and a
    compressed-tensors int8 checkpoint with one scale a
    row, each rank's row-parallel columns taking the row's (kernels in float32: in bfloat16 each rank's
    partial sum is rounded before the all-reduce, which a random model's flat logits do not survive).

    (int8 per-channel quantized at load time is left out: under tensor parallelism a row-parallel layer's
    channel is the rank's slice of the row, so its scales differ from one rank's.)"""
    from tests.unit.test_quantized_checkpoints import write_checkpoint

    write_gguf(float_dir, tmp_path / "m.gguf", "Q4_1", head_kind="Q8_0")
    write_checkpoint(float_dir, tmp_path / "ct", "ct w8a16")
    loads = [
        (str(float_dir), QuantizationConfig("int4", group_size=32)),
        (str(float_dir), QuantizationConfig("gguf", gguf_file=str(tmp_path / "m.gguf"))),
        (str(tmp_path / "ct"), QuantizationConfig("compressed-tensors")),
    ]
    with exact_kernels():
        models = [load_model(model_dir, torch.float32, CPU, quantization=q) for model_dir, q in loads]
    single = [greedy(model, PROMPTS, 8) for model in models]
    mp.spawn(_sharded_greedy, args=(2, loads, str(tmp_path)), nprocs=2)
    for rank in range(2):
        for (rank_tokens, rank_logits), (tokens, logits) in zip(torch.load(tmp_path / f"rank{rank}.pt"), single):
            assert rank_tokens == tokens
            torch.testing.assert_close(rank_logits, logits, rtol=1e-5, atol=1e-5)


def test_a_quantized_layer_refuses_float_values_for_its_codes():
    from pipeline.gpu_worker.layers.linear import QKVParallelLinear

    layer = QKVParallelLinear(64, 16, 4, 2, bias=False)
    layer.quantize(4, 32)
    assert layer.weight.dtype == torch.uint8 and layer.weight_scale.shape == (128, 2)
    with pytest.raises(
        ValueError, match=r"dtype torch\.float32 in the checkpoint, the quantized layer holds torch\.uint8"
    ):
        layer.weight.weight_loader(layer.weight, torch.zeros(64, 64), "q")
    with pytest.raises(
        ValueError, match=r"dtype torch\.int8 in the checkpoint, the quantized layer holds torch\.uint8"
    ):
        layer.weight.weight_loader(layer.weight, torch.zeros(64, 64, dtype=torch.int8), "q")
    assert layer.weight.weight_loader(layer.weight, torch.zeros(64, 64, dtype=torch.uint8), "q") == ("q",)
