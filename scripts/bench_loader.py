"""Peak host memory and time of loading a checkpoint: the old loader against the safetensors loader.

Writes a random Llama checkpoint (TinyLlama-1.1B's shape by default, about
1.1 B parameters) to a temporary directory as sharded safetensors, then loads
it in a fresh process per run and reports, per loader:

- peak RSS: the process's peak resident memory during the load minus its
  resident memory just before (imports done), divided by the loaded weights'
  bytes (one rank's, in ``--dtype``); the issue's bound is 1.3;
- seconds: wall time of the load.

``old`` is the loader this project had before (kept here only): transformers
reads the checkpoint into a float32 model, whose state dict is copied into
ours, built in float32 and then cast. ``new`` is
``pipeline.gpu_worker.models.loader.load_model``. Runs alternate (old, new,
old, new, ...) so both see the same page cache; the checkpoint was just
written, so reads come from the page cache, not the disk.

    python scripts/bench_loader.py                      # ~1.1 B parameters, bfloat16 checkpoint, float32 load
    python scripts/bench_loader.py --dtype bfloat16 --repeat 3
    python scripts/bench_loader.py --tp 2               # the new loader's rank 0 of 2 (old: whole model)
    python scripts/bench_loader.py --hidden 256 --layers 2 --intermediate 512 --vocab 1024   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_checkpoint(d: Path, args) -> int:
    """A random Llama in ``d`` (config.json, sharded safetensors, index); returns its parameter count."""
    import torch
    from safetensors.torch import save_file

    head_dim = args.hidden // args.heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": args.checkpoint_dtype,
    }
    (d / "config.json").write_text(json.dumps(config, indent=1))
    h, i, kv = args.hidden, args.intermediate, args.kv_heads * head_dim
    shapes = {
        "model.embed_tokens.weight": (args.vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (args.vocab, h),
    }
    for n in range(args.layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    dtype = getattr(torch, args.checkpoint_dtype)
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, shard_bytes, files, total = {}, {}, 0, [], 0

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(d / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))

    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
        shard[name] = t
        shard_bytes += t.numel() * t.element_size()
        total += t.numel()
        if shard_bytes >= args.shard_gb * 2**30:
            flush()
            shard, shard_bytes = {}, 0
    if shard:
        flush()
    index = {"metadata": {"total_size": total * torch.empty((), dtype=dtype).element_size()}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def _status_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in bytes.

    Not ``getrusage``: Linux carries ``ru_maxrss`` over fork and exec, so a
    child would report this script's own peak from writing the checkpoint.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(loader: str, model_dir: str, dtype_name: str, tp: int) -> None:
    """One load in this process; prints a JSON line of its figures."""
    import gc

    import torch
    import transformers

    from pipeline.common.model_config import ModelConfig
    from pipeline.gpu_worker.layers.tp import TPGroup
    from pipeline.gpu_worker.models.loader import build_model, load_model

    dtype, cpu = getattr(torch, dtype_name), torch.device("cpu")
    transformers.AutoConfig.from_pretrained(model_dir)  # both loaders read it: its imports are not the load's
    before = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    if loader == "old":
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = build_model(ModelConfig.from_hf(hf.config), torch.float32, cpu, "torch_bucketed")
        model.load_weights(hf.state_dict().items())
        del hf
        gc.collect()
        model.to(dtype)
    else:
        model = load_model(model_dir, dtype, cpu, "torch_bucketed", tp=TPGroup(0, tp))
    seconds = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"loader": loader, "seconds": seconds, "weights": weights, "before": before, "peak": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--checkpoint-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype loaded into")
    parser.add_argument("--shard-gb", type=float, default=1.0, help="safetensors file size")
    parser.add_argument("--tp", type=int, default=1, help="the new loader loads rank 0 of this many")
    parser.add_argument("--repeat", type=int, default=2, help="runs per loader, alternating")
    parser.add_argument("--loaders", nargs="+", default=["old", "new"], choices=["old", "new"])
    parser.add_argument("--child", nargs=4, metavar=("LOADER", "DIR", "DTYPE", "TP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        loader, d, dtype, tp = args.child
        child(loader, d, dtype, int(tp))
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
        d = Path(tmp)
        t0 = time.perf_counter()
        params = write_checkpoint(d, args)
        print(
            f"checkpoint: {params / 1e9:.2f} B parameters in {args.checkpoint_dtype}, "
            f"written in {time.perf_counter() - t0:.0f} s; loading into {args.dtype}, tp {args.tp}"
        )
        for _ in range(args.repeat):
            for loader in args.loaders:
                cmd = [sys.executable, __file__, "--child", loader, str(d), args.dtype, str(args.tp)]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                grew = r["peak"] - r["before"]
                print(
                    f"{loader:>4}: {r['seconds']:6.1f} s  peak RSS - before = {grew / 2**30:5.2f} GiB"
                    f" = {grew / r['weights']:.2f} x weights ({r['weights'] / 2**30:.2f} GiB)"
                    f"  [absolute peak {r['peak'] / r['weights']:.2f} x]",
                    flush=True,
                )


if __name__ == "__main__":
    main()
