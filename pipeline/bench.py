"""``pipeline-bench``: token gap, device-busy fraction, throughput, TTFT and ITL.

Without ``--http`` the benchmark starts the scheduler and the worker as real
processes and plays io_proc's part itself (the same EngineClient: control
over zmq, tokens from the output ring, incremental detokenization), so no
HTTP cost is in the figures. With ``--http`` it starts the whole server (or
uses ``--url``) and streams requests through the OpenAI API.

``--mode both`` runs asynchronous scheduling and lock step back to back in
one invocation, on the same workload, and reports their ratios: this
machine is shared and noisy, so only figures measured together compare.
Token gap and busy fraction come from the worker's per-step device spans
(docs/design.md, "Measuring the token gap").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
from tqdm import tqdm

from pipeline.common.messages import SamplingParams
from pipeline.common.trace import (
    ROLES, TraceRecorder, device_spans, gap_metrics, token_gaps_us,
)
from pipeline.launcher import ChildFailed, Launcher, build_parser, make_config

# Prompt token ids are drawn from this range: ordinary words in SmolLM2's vocabulary.
_WORD_IDS = (1000, 9000)


@dataclass
class Workload:
    """Prompts (token ids) and output lengths; every request ignores EOS."""

    prompts: list[list[int]]
    output_lens: list[int]

    @classmethod
    def fixed(cls, batch_size: int, input_len: int, output_len: int, seed: int) -> "Workload":
        rng = random.Random(seed)
        return cls([[rng.randrange(*_WORD_IDS) for _ in range(input_len)] for _ in range(batch_size)],
                   [output_len] * batch_size)

    @classmethod
    def sharegpt_synth(cls, num_requests: int, max_model_len: int, seed: int) -> "Workload":
        """Long-tailed lengths like ShareGPT conversations: log-normal prompt
        (median 180 tokens) and output (median 130) lengths, clipped to fit."""
        rng = np.random.default_rng(seed)
        inp = np.clip(rng.lognormal(np.log(180), 1.0, num_requests), 4, max_model_len // 2).astype(int)
        out = np.clip(rng.lognormal(np.log(130), 0.9, num_requests), 2, max_model_len // 2 - 1).astype(int)
        r = random.Random(seed)
        return cls([[r.randrange(*_WORD_IDS) for _ in range(n)] for n in inp.tolist()], out.tolist())


@dataclass
class RequestTimes:
    submit: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one entry per output token
    num_tokens: int = 0


def summarize(times: list[RequestTimes], spans: list) -> dict:
    """Per-mode figures from client-side token times and the worker's device spans.

    Wall time runs from the first request's submission to the last token.
    """
    wall_s = max(t.token_times[-1] for t in times if t.token_times) - min(t.submit for t in times)
    ttft = [t.token_times[0] - t.submit for t in times if t.token_times]
    itl = [b - a for t in times for a, b in zip(t.token_times, t.token_times[1:])]
    dev = device_spans(spans)
    out = {
        **gap_metrics(dev),
        "output_tokens_per_s": sum(t.num_tokens for t in times) / wall_s,
        "ttft_ms": {"p50": float(np.percentile(ttft, 50) * 1e3), "p99": float(np.percentile(ttft, 99) * 1e3)},
        "itl_ms": ({"p50": float(np.percentile(itl, 50) * 1e3), "p99": float(np.percentile(itl, 99) * 1e3)}
                   if itl else None),
        "num_steps": int(len(dev)) if len(dev) else None,
        "num_requests": len(times),
        "output_tokens": sum(t.num_tokens for t in times),
        "wall_s": wall_s,
    }
    return out


async def _drive_engine(client, work: Workload, bar) -> list[RequestTimes]:
    """Submit every request at once through an in-process EngineClient.

    Consumers wait for the finish only; each request's token timeline comes
    from the delivery times the client records per step, so the benchmark
    measures the runtime rather than a thousand coroutine wake-ups per step.
    """
    async def one(i: int) -> RequestTimes:
        params = SamplingParams(max_tokens=work.output_lens[i], temperature=0.0, seed=i, ignore_eos=True)
        state = client.add_request(work.prompts[i], params, stop=(), streaming=False)
        try:
            await state.wait_finished()
        finally:
            client.release(state)
        t = RequestTimes(submit=state.arrival_time, num_tokens=state.num_output_tokens)
        done = 0
        for when, n in state.delivery_times:
            t.token_times.extend([when] * (n - done))
            done = n
        bar.update(t.num_tokens)
        return t

    return await asyncio.gather(*(one(i) for i in range(len(work.prompts))))


async def _drive_http(url: str, model: str, work: Workload, bar) -> list[RequestTimes]:
    import httpx

    async def one(client, i: int) -> RequestTimes:
        t = RequestTimes(submit=time.perf_counter())
        body = {"model": model, "prompt": work.prompts[i], "max_tokens": work.output_lens[i], "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                    now = time.perf_counter()
                    t.token_times.extend([now] * len(ids))
                    bar.update(len(ids))
        t.num_tokens = len(t.token_times)
        return t

    limits = httpx.Limits(max_connections=len(work.prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(len(work.prompts))))


def run_mode(args: argparse.Namespace, work: Workload, async_scheduling: bool,
             trace_file: str | None) -> tuple[dict, list]:
    """Run ``work`` once in one scheduling mode; returns (figures, spans)."""
    label = "async" if async_scheduling else "sync"
    bar = tqdm(total=sum(work.output_lens), desc=f"{label:5s}", unit="tok", file=sys.stderr)
    if args.url:
        import httpx
        model = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        times = asyncio.run(_drive_http(args.url, model, work, bar))
        bar.close()
        return summarize(times, []), []

    # Spans are always recorded: the gap figures come from them.
    config = msgspec.structs.replace(make_config(args), async_scheduling=async_scheduling, trace=True)
    launcher = Launcher(config, roles=ROLES if args.http else ("scheduler", "gpu_worker"),
                        trace_file=trace_file, profile_dir=os.path.join(args.profile, label) if args.profile else None)
    recorder = TraceRecorder()
    launcher.extra_spans = recorder.spans
    try:
        launcher.start()
        if args.http:
            times = asyncio.run(_drive_http(f"http://{config.host}:{config.port}", config.served_model_name,
                                            work, bar))
        else:
            times = asyncio.run(_engine_session(config, launcher, recorder, work, bar))
    finally:
        bar.close()
        launcher.stop()
    return summarize(times, launcher.spans), launcher.spans


async def _engine_session(config, launcher: Launcher, recorder: TraceRecorder, work: Workload, bar):
    from pipeline.io_proc.engine_client import EngineClient
    from pipeline.io_proc.tokenization import Tokenization, load_tokenizer

    tokenizer, _ = load_tokenizer(config.tokenizer)
    tokenization = Tokenization(tokenizer)
    client = EngineClient(config, launcher.output_ring, tokenization.make_decoder(), recorder)
    client.start()
    try:
        return await _drive_engine(client, work, bar)
    finally:
        await client.stop()
        client.close()
        tokenization.close()


def print_table(results: dict[str, dict]) -> None:
    """One row per figure, one column per mode (plus async/sync when both ran)."""
    rows = [("token gap p50 (us)", lambda r: r["token_gap_us"] and r["token_gap_us"]["p50"]),
            ("token gap p90 (us)", lambda r: r["token_gap_us"] and r["token_gap_us"]["p90"]),
            ("token gap p99 (us)", lambda r: r["token_gap_us"] and r["token_gap_us"]["p99"]),
            ("token gap max (us)", lambda r: r["token_gap_us"] and r["token_gap_us"]["max"]),
            ("token gap mean (us)", lambda r: r["token_gap_us"] and r["token_gap_us"]["mean"]),
            ("device busy fraction", lambda r: r["device_busy_fraction"]),
            ("output tokens/s", lambda r: r["output_tokens_per_s"]),
            ("TTFT p50 (ms)", lambda r: r["ttft_ms"]["p50"]),
            ("TTFT p99 (ms)", lambda r: r["ttft_ms"]["p99"]),
            ("ITL p50 (ms)", lambda r: r["itl_ms"] and r["itl_ms"]["p50"]),
            ("ITL p99 (ms)", lambda r: r["itl_ms"] and r["itl_ms"]["p99"]),
            ("steps", lambda r: r["num_steps"]),
            ("wall time (s)", lambda r: r["wall_s"])]
    modes = list(results)
    both = len(modes) == 2
    head = ["figure", *modes] + (["async/sync"] if both else [])
    lines = [head]
    for name, get in rows:
        vals = [get(results[m]) for m in modes]
        cells = [name] + ["-" if v is None else f"{v:.4g}" for v in vals]
        if both:
            cells.append(f"{vals[0] / vals[1]:.3g}" if vals[0] is not None and vals[1] else "-")
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    for i, r in enumerate(lines):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def plot(results: dict[str, dict], spans: dict[str, list], path: str) -> None:
    """Gap histogram of each mode and a strip of each mode's step timeline."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, axes = plt.subplots(1 + len(modes), 1, figsize=(10, 3 + 1.6 * len(modes)),
                             gridspec_kw={"height_ratios": [3] + [1] * len(modes)})
    ax = axes[0]
    for m, color in zip(modes, ("tab:blue", "tab:orange")):
        gaps = token_gaps_us(device_spans(spans[m]))
        if len(gaps):
            bins = np.logspace(0, max(1.0, np.log10(gaps.max() + 1) + 0.1), 50)
            ax.hist(gaps + 1, bins=bins, alpha=0.6, color=color,
                    label=f"{m}: p50 {np.percentile(gaps, 50):.0f} us, p99 {np.percentile(gaps, 99):.0f} us")
    ax.set_xscale("log")
    ax.set_xlabel("token gap + 1 (us): device start of step N+1 - device end of step N")
    ax.set_ylabel("steps")
    ax.legend()
    for ax, m in zip(axes[1:], modes):
        dev = device_spans(spans[m])
        if not len(dev):
            continue
        mid = len(dev) // 2
        win = dev[mid:mid + 12]
        t0 = win[0, 0]
        ax.broken_barh([((a - t0) / 1e6, (b - a) / 1e6) for a, b in win], (0, 1), facecolor="tab:green",
                       edgecolor="black", linewidth=0.4)
        ax.set_yticks([])
        ax.set_ylabel(m, rotation=0, ha="right", va="center")
        ax.set_xlabel("ms (12 steps from mid-run; white = device idle)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_bench_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "pipeline-bench"
    p.description = __doc__.split("\n\n")[0] + " " + " ".join(__doc__.split("\n\n")[1].split())
    g = p.add_argument_group("benchmark")
    g.add_argument("--workload", choices=["fixed", "sharegpt-synth"], default="fixed",
                   help="fixed: --batch-size requests of --input-len prompt and --output-len output tokens; "
                        "sharegpt-synth: --num-requests with long-tailed lengths. All arrive at once, ignore EOS.")
    g.add_argument("--batch-size", type=int, default=64, help="fixed workload: number of requests")
    g.add_argument("--input-len", type=int, default=32, help="fixed workload: prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="fixed workload: output tokens")
    g.add_argument("--num-requests", type=int, default=200, help="sharegpt-synth: number of requests")
    g.add_argument("--seed", type=int, default=0, help="workload seed")
    g.add_argument("--mode", choices=["async", "sync", "both"], default="both",
                   help="scheduling mode(s); both runs async then sync and reports ratios")
    g.add_argument("--http", action="store_true",
                   help="start the whole server and send requests through the OpenAI API")
    g.add_argument("--url", default=None, help="with --http: benchmark a running server instead (no gap figures)")
    g.add_argument("--json", metavar="FILE", default=None, help="write the figures per mode here")
    g.add_argument("--plot", metavar="FILE.png", default=None, help="draw gap histograms and a timeline strip")
    return p


def main(argv: list[str] | None = None) -> None:
    """Console entry of ``pipeline-bench``."""
    args = build_bench_parser().parse_args(argv)
    if args.url:
        args.http = True
    if args.workload == "fixed":
        # Every request of the batch runs at once: give the engine room for it.
        args.max_num_seqs = max(args.max_num_seqs, args.batch_size)
        args.max_num_batched_tokens = max(args.max_num_batched_tokens, args.batch_size)
        work = Workload.fixed(args.batch_size, args.input_len, args.output_len, args.seed)
    else:
        work = Workload.sharegpt_synth(args.num_requests, args.max_model_len or 2048, args.seed)
        args.max_model_len = args.max_model_len or 2048
    unused = {"json", "plot", "trace", "async_scheduling",
              *(("num_requests",) if args.workload == "fixed" else ("batch_size", "input_len", "output_len"))}
    modes = {"async": [True], "sync": [False], "both": [True, False]}[args.mode]
    trace = args.trace
    results, spans = {}, {}
    try:
        for a in modes:
            label = "async" if a else "sync"
            tf = trace
            if trace and len(modes) == 2:
                root, ext = os.path.splitext(trace)
                tf = f"{root}.{label}{ext or '.json'}"
            results[label], spans[label] = run_mode(args, work, a, tf)
            results[label]["config"] = {k: v for k, v in vars(args).items() if k not in unused}
    except (ChildFailed, TimeoutError) as e:
        print(f"pipeline-bench: {e}", file=sys.stderr)
        raise SystemExit(1)
    print_table(results)
    if args.json:
        out = dict(results)
        if len(results) == 2:
            a, s = results["async"], results["sync"]
            out["ratio_async_over_sync"] = {"output_tokens_per_s": a["output_tokens_per_s"] / s["output_tokens_per_s"]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        plot(results, spans, args.plot)


if __name__ == "__main__":
    main()
