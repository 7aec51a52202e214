"""A torch.profiler timeline of decode steps as the model worker runs them, for Perfetto or chrome://tracing.

Builds the worker's runner the way the worker does (``load_runner``: the server's config from
its flags, the KV cache, CUDA graphs), prefills ``--batch`` requests of ``--prompt-len`` tokens,
runs ``--warmup`` decode steps, then records ``--steps`` decode steps with the profiler: host
calls and, on CUDA, the device's kernels and copies. Each step is launched before the previous
one is finished, as under asynchronous scheduling, so the timeline shows whether the device
waits between steps. Writes a gzipped Chrome trace and prints the most expensive operations.

    python scripts/gpu_profile.py MODEL_DIR OUT.json.gz [--batch 64] [--steps 20] [--device cuda]
                                              [--attention-backend NAME]
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import tempfile
import time
from pathlib import Path

import torch

from pipeline.common.constants import cdiv
from pipeline.common.descriptor_builder import DescriptorBuilder
from pipeline.common.messages import SamplingParams
from pipeline.common.step_protocol import PLACEHOLDER_TOKEN_ID, StepDescriptor, read_descriptor
from pipeline.gpu_worker.main import load_runner
from pipeline.server_args import build_parser
from pipeline.server_config import make_config

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0)


class Decode:
    """Writes the steps' descriptors as the scheduler would: one run of blocks per request."""

    def __init__(self, config, batch: int, prompt_len: int):
        self.config, self.layout = config, config.descriptor_layout
        self.per_row = cdiv(config.max_model_len, config.scheduler.block_size)
        self.pos = [0] * batch
        self.prompts = [[(7 * i + j) % 1000 + 100 for j in range(prompt_len)] for i in range(batch)]
        self.step_id = 0

    def next(self):
        """The next step: every prompt at once first, then one placeholder token per request."""
        b = DescriptorBuilder()
        for i, pos in enumerate(self.pos):
            ids, params = (self.prompts[i], GREEDY) if pos == 0 else ([PLACEHOLDER_TOKEN_ID], None)
            b.add_row(i, i, pos, ids, True, params)
            for col in range(
                cdiv(pos, self.config.scheduler.block_size), cdiv(pos + len(ids), self.config.scheduler.block_size)
            ):
                b.add_block(i, col, i * self.per_row + col)
            self.pos[i] += len(ids)
        desc = StepDescriptor(self.layout.views(bytearray(self.layout.nbytes)))
        b.write(desc, self.step_id)
        self.step_id += 1
        return read_descriptor(desc)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a Hugging Face model directory")
    p.add_argument("out", type=Path, help="the gzipped Chrome trace to write (.json.gz)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=10, help="decode steps before the recorded ones")
    p.add_argument("--steps", type=int, default=20, help="decode steps recorded")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--attention-backend", default="auto", help="as pipeline-serve's")
    return p


def main() -> None:
    args = parser().parse_args()

    max_model_len = 512
    flags = ["--model", args.model, "--device", args.device, "--max-model-len", str(max_model_len)]
    flags += ["--max-num-seqs", str(args.batch), "--max-num-batched-tokens", str(args.batch * args.prompt_len)]
    flags += ["--num-kv-blocks", str(args.batch * cdiv(max_model_len, 16)), "--block-size", "16"]
    flags += ["--attention-backend", args.attention_backend] + (["--enforce-eager"] if args.enforce_eager else [])
    config = make_config(build_parser().parse_args(flags))
    shutil.rmtree(config.ipc_dir)  # no server: nothing is exchanged through it
    runner, _ = load_runner(config, 0)
    decode = Decode(runner.config, args.batch, args.prompt_len)
    pending = None

    def step() -> None:
        nonlocal pending
        launched = runner.launch(decode.next(), time.monotonic_ns())
        if pending is not None:
            runner.finish(pending)
        pending = launched

    for _ in range(1 + args.warmup):  # the prefill, then the warm-up decodes
        step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(args.steps):
            with torch.profiler.record_function(f"decode step {i}"):
                step()
        runner.finish(pending)
    wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp, "trace.json")
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(args.out, "wb") as dst:
            shutil.copyfileobj(src, dst)
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=15))
    graphs = "eager" if args.enforce_eager or args.device != "cuda" else "CUDA graphs"
    backend = runner.executor.model.attn_backend.name
    print(
        f"gpu_profile: {args.steps} decode steps of {args.batch} rows ({graphs}, {backend}) "
        f"in {wall * 1e3:.1f} ms under the profiler; trace {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
