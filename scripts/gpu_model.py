"""A Llama-3.2-1B-shaped model with random bfloat16 weights, for timing steps where no checkpoint can travel.

How long a step takes depends on the model's shape, not on its weights. The config is Llama
3.2 1B's: hidden 2048, 16 layers, 32 query and 8 KV heads of 64, MLP 8192, a vocabulary of 128256
(tied embeddings), llama3 rotary scaling. The tokenizer is SmolLM2's (49152 ids, carried as
files, .gpu-carry/tokenizer): ids past it, which a random model samples often, decode to no
text, as a padded LM head's do, so io_proc detokenizes less than it would with Llama 3's own.
``--tiny`` keeps the vocabulary and shrinks the rest, to check the build on a CPU in seconds.

    python scripts/gpu_model.py OUT_DIR --tokenizer DIR [--device cuda] [--tiny] [--meta]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

LLAMA_3_2_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
}
# Parameters of Llama 3.2 1B (embeddings counted once: they are tied).
LLAMA_3_2_1B_PARAMETERS = 1_235_814_400
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY.update(num_key_value_heads=2, head_dim=16)


def model_config(tokenizer_dir: Path, tiny: bool = False) -> LlamaConfig:
    """Llama 3.2 1B's config (or its tiny variant) with the tokenizer's special token ids."""
    cfg = json.loads((tokenizer_dir / "generation_config.json").read_text())
    fields = {**LLAMA_3_2_1B, **(TINY if tiny else {})}
    return LlamaConfig(
        **fields,
        architectures=["LlamaForCausalLM"],
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
    )


def num_parameters(cfg: LlamaConfig) -> int:
    """The model's parameter count, from a build on the meta device (no memory, no time)."""
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).num_parameters()


def build(out: Path, tokenizer_dir: Path, device: str = "cpu", tiny: bool = False) -> Path:
    """Save a random-weight model (safetensors, bfloat16) with the tokenizer's files in ``out``."""
    cfg = model_config(tokenizer_dir, tiny)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: on a GPU in a second, not a minute of CPU
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).write_bytes(f.read_bytes())
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id).save_pretrained(out)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="directory to write (created)")
    p.add_argument("--tokenizer", type=Path, required=True, help="a directory of tokenizer files")
    p.add_argument("--device", default="cpu", help="where to initialise the weights")
    p.add_argument("--tiny", action="store_true", help="2 layers of 64: a quick check of the build")
    p.add_argument(
        "--meta",
        action="store_true",
        help="write config.json only, count the parameters on the meta device and read the config as the "
        "server does: checks the shape without the weights' 2.5 GB",
    )
    return p


def main() -> int:
    args = parser().parse_args()
    cfg = model_config(args.tokenizer, args.tiny)
    n = num_parameters(cfg)
    if args.meta:
        from pipeline.common.model_files import read_model_config

        cfg.save_pretrained(args.out)
        read_model_config(args.out)  # raises if the server would refuse it
        expected = None if args.tiny else LLAMA_3_2_1B_PARAMETERS
        print(f"gpu_model: config in {args.out}, {n:,} parameters (Llama 3.2 1B: {LLAMA_3_2_1B_PARAMETERS:,})")
        return 0 if expected in (None, n) else 1
    t0 = time.monotonic()
    build(args.out, args.tokenizer, args.device, args.tiny)
    size = sum(f.stat().st_size for f in args.out.iterdir()) / 2**30
    print(f"gpu_model: {n:,} parameters, {size:.2f} GiB in {args.out} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
