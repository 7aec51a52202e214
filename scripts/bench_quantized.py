"""Decode tokens/s and resident memory of quantized linear weights against float ones, on the bare model.

Writes a random Llama checkpoint in bfloat16 (Llama-3.2-1B's layer shape by
default: hidden 2048, MLP 8192, 32 query and 8 KV heads; fewer layers and a
smaller vocabulary than the real model so that a 2-core machine finishes,
see the flags), then for each format

- ``float32`` and ``bfloat16``: ``--quantization none`` in that dtype;
- ``int8``: per-channel, ``int4``: groups of 128, both quantized at load time
  in a float32 model (the CPU's default ``--dtype``), multiplied by the
  compiled CPU kernel (``layers/quant_cpu.py``, in float32);
- ``int8`` and ``int4, bfloat16 model``: the same weights in a bfloat16
  model, where the CPU kernel rounds the activations to int8 and multiplies
  with integer dot products (AVX-512 VNNI; elsewhere the float32 kernel);
- ``int4, torch's op``: the same int4 weights in a bfloat16 model through
  torch's ``_weight_int4pack_mm_for_cpu`` (in bfloat16), the path the kernel
  replaced;
- ``int8 g32, dequantizing``: group-wise int8 where the compiled kernel is
  off, dequantized on every call (the path of int8 with a zero: Q5_K);

reports the resident memory a fresh process gains by loading it (``VmRSS``
after minus before, imports done) beside the bytes of the model's tensors
(codes, scales, embedding, norms; a tied head once) and their ratio, and the decode tokens/s of one step of B
rows, each at ``--context`` tokens of context, for each batch size B. Every
format is loaded in this one process and the measurements interleave: each
round runs every (batch, format) pair once, in turn, so load from other
programs falls on all formats alike; the figure is each pair's best round.
With ``--smollm`` the default model is measured the same way: its GGUF
file's Q4_1 weights as they are (``auto``), by the kernel and by torch's op,
against the float32 expansion (``none``).

    python scripts/bench_quantized.py                              # 4 layers of Llama-3.2-1B's shape
    python scripts/bench_quantized.py --layers 16 --vocab 128256   # the whole 1B shape (slow on 2 cores)
    python scripts/bench_quantized.py --smollm --batches 1,8,32,64
    python scripts/bench_quantized.py --gguf DIR/llama-1b-shape-4L-{F16,Q8_0,Q4_K_M}.gguf   # scripts/write_gguf.py's
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

# name -> (model dtype, QuantizationConfig fields, whether the compiled CPU kernel may run the quantized weights)
FORMATS = {
    "float32": ("float32", {}, True),
    "bfloat16": ("bfloat16", {}, True),
    "int8": ("float32", {"method": "int8"}, True),
    "int4": ("float32", {"method": "int4", "group_size": 128}, True),
    "int8, bfloat16 model": ("bfloat16", {"method": "int8"}, True),
    "int4, bfloat16 model": ("bfloat16", {"method": "int4", "group_size": 128}, True),
    "int4, torch's op, bfloat16 model": ("bfloat16", {"method": "int4", "group_size": 128}, False),
    # No kernel takes group-wise int8 outside the panel kernel: the path of int8 with a zero (Q5_K).
    "int8 g32, dequantizing": ("float32", {"method": "int8", "group_size": 32}, False),
}
BLOCK_SIZE = 16


def load(model_dir: str, dtype_name: str, quant: dict, cpu_kernel: bool):
    import torch

    from pipeline.common.config import QuantizationConfig
    from pipeline.gpu_worker.layers import quant as quant_layer
    from pipeline.gpu_worker.models.loader import load_model

    quant_layer.CPU_KERNEL = cpu_kernel
    try:
        return load_model(
            model_dir, getattr(torch, dtype_name), torch.device("cpu"), quantization=QuantizationConfig(**quant)
        )
    finally:
        quant_layer.CPU_KERNEL = True


def child_memory(model_dir: str, dtype_name: str, quant: str, cpu_kernel: str) -> None:
    """Load one format in this fresh process; print the resident bytes it added and the bytes of the model's
    tensors (parameters and buffers, a tied table's oneDNN copy included; shared storage once), as JSON."""
    import transformers
    from bench_loader import _status_bytes

    from pipeline.gpu_worker.layers import quant_cpu

    transformers.AutoConfig.from_pretrained(model_dir)  # the imports load_model makes are not the weights'
    quant_cpu.unavailable_reason()  # nor is the kernel's library
    before = _status_bytes("VmRSS")
    model = load(model_dir, dtype_name, json.loads(quant), cpu_kernel == "1")
    rss = _status_bytes("VmRSS") - before
    tensors = {}  # storage -> bytes; oneDNN's packed weights are opaque: their elements' bytes
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_mkldnn:
            tensors[id(t)] = t.numel() * t.element_size()
        else:
            tensors[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    print(json.dumps({"rss_bytes": rss, "weight_bytes": sum(tensors.values())}))


def decode_seconds(model, dtype, batch: int, context: int, steps: int) -> float:
    """Seconds of ``steps`` decode steps of ``batch`` rows at ``context`` tokens each (after one warm-up)."""
    import torch

    blocks_per_seq = -(-(context + steps + 1) // BLOCK_SIZE)
    caches = model.allocate_kv_caches(batch * blocks_per_seq, BLOCK_SIZE, dtype, torch.device("cpu"))
    table = torch.arange(batch * blocks_per_seq).reshape(batch, blocks_per_seq)
    ids = torch.randint(0, model.config.vocab_size, (batch,))
    ones = torch.ones(batch, dtype=torch.long)

    def step(pos: int) -> None:
        meta = model.attn_backend.build_from_rows(ones, torch.full((batch,), pos), table, BLOCK_SIZE)
        with torch.inference_mode():
            model.compute_logits(model(ids, meta.positions, meta, caches))

    step(context)
    t0 = time.perf_counter()
    for i in range(steps):
        step(context + 1 + i)
    return time.perf_counter() - t0


def interleaved(models: dict, batches: list[int], args) -> dict[tuple[str, int], float]:
    """Best decode tokens/s of each (format, batch) over ``args.rounds`` interleaved rounds."""
    best: dict[tuple[str, int], float] = {}
    for r in range(args.rounds):
        for batch in batches:
            for name, (model, dtype) in models.items():
                tps = batch * args.steps / decode_seconds(model, dtype, batch, args.context, args.steps)
                best[name, batch] = max(best.get((name, batch), 0.0), tps)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return best


def memory(model_dir: str, formats: dict) -> dict[str, tuple[float, float]]:
    """(MiB each format's load adds to a fresh process, MiB of the model's tensors)."""
    out = {}
    for name, (dtype_name, quant, cpu_kernel) in formats.items():
        cmd = [
            sys.executable,
            __file__,
            "--child-memory",
            model_dir,
            dtype_name,
            json.dumps(quant),
            str(int(cpu_kernel)),
        ]
        line = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout.splitlines()[-1]
        found = json.loads(line)
        out[name] = (found["rss_bytes"] / 2**20, found["weight_bytes"] / 2**20)
    return out


def table(title: str, best: dict, mib: dict, batches: list[int]) -> None:
    names = list(mib)
    print(f"\n{title}\n")
    print("| format | resident MiB | tensors MiB | ratio | " + " | ".join(f"tok/s B={b}" for b in batches) + " |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in batches) + " |")
    for name in names:
        cells = " | ".join(f"{best[name, b]:.1f}" for b in batches)
        rss, weights = mib[name]
        print(f"| {name} | {rss:.0f} | {weights:.0f} | {rss / weights:.2f} | {cells} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes, comma-separated")
    p.add_argument("--context", type=int, default=128, help="tokens of context of every row")
    p.add_argument("--steps", type=int, default=4, help="decode steps timed per measurement")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; each pair's best counts")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--random",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the random checkpoint's formats (--no-random: only --smollm's and --gguf's)",
    )
    p.add_argument("--smollm", action="store_true", help="also the default model: Q4_1 as it ships vs float32")
    p.add_argument(
        "--gguf",
        nargs="*",
        default=[],
        help="also these GGUF files (scripts/write_gguf.py writes the 1B shape's), as served, in bfloat16 and float32",
    )
    p.add_argument("--child-memory", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_memory:
        child_memory(*args.child_memory)
        return
    import torch
    from bench_loader import write_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu {torch.backends.cpu.get_cpu_capability()}"
    )
    if args.random:
        with tempfile.TemporaryDirectory() as d:
            args.checkpoint_dtype, args.shard_gb = "bfloat16", 2.0
            n = write_checkpoint(Path(d), args)
            print(f"random Llama: {n / 1e6:.0f} M parameters, {args.layers} layers of hidden {args.hidden}")
            measure(f"Llama-3.2-1B-shaped, {args.layers} layers, vocab {args.vocab}", d, FORMATS, batches, args)
    if args.smollm:
        from pipeline.common.model_files import default_model_path

        gguf = default_model_path()
        q4_1 = {"method": "gguf", "gguf_file": str(gguf)}
        smol = {
            "Q4_1 (auto)": ("float32", q4_1, True),
            "Q4_1, torch's op": ("float32", q4_1, False),
            "Q4_1, bfloat16 model": ("bfloat16", q4_1, True),
            "float32 (none)": ("float32", {}, True),
            "bfloat16 (none)": ("bfloat16", {}, True),
        }
        measure("SmolLM2-135M-Instruct", gguf, smol, batches, args)
    if args.gguf:
        # As served (--quantization auto), each file in each dtype, interleaved; files of one model (one config:
        # the first file's converted directory), their weights each file's own.
        files = {
            f"{Path(path).stem}, {dtype}": (dtype, {"method": "gguf", "gguf_file": str(Path(path).resolve())}, True)
            for path in args.gguf
            for dtype in ("bfloat16", "float32")
        }
        measure(", ".join(Path(path).name for path in args.gguf), Path(args.gguf[0]), files, batches, args)


def measure(title: str, model: Path | str, formats: dict, batches: list[int], args) -> None:
    """Print the table of ``formats`` of one model: a checkpoint directory, or a GGUF file (its Hugging Face
    directory converted once for the config, the formats' ``gguf_file`` for the weights)."""
    import torch

    from pipeline.common.model_files import convert_gguf

    model_dir = str(convert_gguf(model)) if str(model).endswith(".gguf") else str(model)
    mib = memory(model_dir, formats)
    models = {name: (load(model_dir, dt, q, k), getattr(torch, dt)) for name, (dt, q, k) in formats.items()}
    best = interleaved(models, batches, args)
    table(f"{title}, context {args.context}", best, mib, batches)


if __name__ == "__main__":
    main()
