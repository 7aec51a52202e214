"""Write a random Llama-3.2-1B-shaped model as GGUF files that llama.cpp's own quantizer made, to serve and compare.

The model has Llama-3.2-1B's layer shape (hidden 2048, MLP 8192, 32 query and
8 KV heads, tied embeddings; fewer layers by default, see the flags) and
SmolLM2's tokenizer (its GGUF file's ``tokenizer.*`` metadata, 49152 tokens),
so that both this server and llama.cpp's load and serve it. Its weights are
random (normal, std 0.02): the outputs are noise, the speed is a real
model's. It is written in float16, then quantized with llama.cpp's quantizer
(``llama_model_quantize`` of llama-cpp-python, run by ``--llama-python``) to
each of ``--types``, which picks each tensor's type as llama.cpp's
``llama-quantize`` does (Q4_K_M: Q6_K for the embedding and some value and
down projections).

    python scripts/write_gguf.py OUT_DIR --llama-python ../llama-venv/bin/python           # Q8_0, Q4_K_M
    python scripts/write_gguf.py OUT_DIR --llama-python ../llama-venv/bin/python --layers 16
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

# llama.cpp's llama_ftype values (llama.h) of the types offered.
FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = 0
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def write_f16(path: Path, args) -> None:
    """The random model in float16, with the default model's tokenizer metadata."""
    import gguf

    from pipeline.common.model_files import default_model_path

    source = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(path, "llama")
    head_dim = args.hidden // args.heads
    writer.add_name(f"random Llama-3.2-1B shape, {args.layers} layers")
    writer.add_context_length(args.context_length)
    writer.add_embedding_length(args.hidden)
    writer.add_block_count(args.layers)
    writer.add_feed_forward_length(args.intermediate)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = 0
    for field in source.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
            if field.name == "tokenizer.ggml.tokens":
                vocab = len(field.data)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(0)

    def random(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", random(vocab, args.hidden))
    writer.add_tensor("output_norm.weight", np.ones(args.hidden, np.float32))
    kv = args.kv_heads * head_dim
    for i in range(args.layers):
        for name, shape in (
            ("attn_q", (args.hidden, args.hidden)),
            ("attn_k", (kv, args.hidden)),
            ("attn_v", (kv, args.hidden)),
            ("attn_output", (args.hidden, args.hidden)),
            ("ffn_gate", (args.intermediate, args.hidden)),
            ("ffn_up", (args.intermediate, args.hidden)),
            ("ffn_down", (args.hidden, args.intermediate)),
        ):
            writer.add_tensor(f"blk.{i}.{name}.weight", random(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(args.hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(args.hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python installed")
    p.add_argument("--types", default="Q8_0,Q4_K_M", help=f"comma-separated, of {', '.join(FTYPES)}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--context-length", type=int, default=4096)
    args = p.parse_args()
    types = args.types.split(",")
    if unknown := [t for t in types if t not in FTYPES]:
        p.error(f"unknown --types {', '.join(unknown)}; choose from {', '.join(FTYPES)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"llama-1b-shape-{args.layers}L"
    f16 = args.out_dir / f"{stem}-F16.gguf"
    print(f"writing {f16}", flush=True)
    write_f16(f16, args)
    for t in types:
        out = args.out_dir / f"{stem}-{t}.gguf"
        print(f"quantizing to {out} with llama.cpp's quantizer", flush=True)
        subprocess.run([args.llama_python, "-c", QUANTIZE, str(f16), str(out), str(FTYPES[t])], check=True)


if __name__ == "__main__":
    sys.exit(main())
