"""``pipeline-bench``: token gap, device-busy fraction, throughput, TTFT and ITL.

Without ``--http`` the benchmark starts the scheduler and the worker as real processes and plays io_proc's part itself
(the same EngineClient: control over zmq, tokens from the output ring, incremental detokenization), so no HTTP cost is
in the figures. With ``--http`` it starts the whole server (or uses ``--url``) and streams requests through the OpenAI
API.

``--mode both`` runs asynchronous scheduling and lock step back to back in one invocation, on the same workload, and
reports their ratios: this machine is shared and noisy, so only figures measured together compare. Token gap and busy
fraction come from the worker's per-step device spans (docs/design.md, "Measuring the token gap").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile

import msgspec
from tqdm import tqdm

from pipeline.bench.bound import BoundReplay
from pipeline.bench.drivers import drive_engine, drive_http
from pipeline.bench.report import plot, print_ratios, print_table, summarize
from pipeline.bench.workloads import MultiTurn, Workload
from pipeline.common.config import EngineConfig
from pipeline.common.trace import ROLES
from pipeline.launcher import ChildFailed, Launcher
from pipeline.server_args import build_parser
from pipeline.server_config import make_config


def run_mode(
    args: argparse.Namespace,
    config: EngineConfig | None,
    http: bool,
    work: Workload | MultiTurn,
    label: str,
    trace_file: str | None,
    concurrency: int | None = None,
) -> tuple[dict, list, EngineConfig | None]:
    """Run ``work`` once (``concurrency`` requests at a time, None: all at once) on ``config``'s processes, or on the
    server at ``--url`` when config is None.

    Returns:
        (figures, spans, the config the processes ran with: its KV blocks sized); no spans or config with ``--url``.
    """
    bar = tqdm(total=total_output(work), desc=f"{label:5s}", unit="tok", file=sys.stderr)
    if config is None:
        import httpx

        model = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        times, spec = asyncio.run(drive_http(args.url, model, work, bar, concurrency))
        bar.close()
        return summarize(times, [], spec), [], None

    launcher = Launcher(
        config,
        roles=ROLES if http else ("scheduler", "gpu_worker"),
        trace_file=trace_file,
        profile_dir=os.path.join(args.profile, label) if args.profile else None,
    )
    try:
        launcher.start()
        config = launcher.config  # the workers may have sized the KV cache
        if http:
            url = f"http://{config.http.host}:{config.http.port}"
            drive = drive_http(url, config.served_model_name, work, bar, concurrency)
        else:
            drive = drive_engine(config, launcher.output_rings, work, bar, concurrency)
        times, spec = asyncio.run(_watched(drive, launcher))
    finally:
        bar.close()
        launcher.stop()
    return summarize(times, launcher.spans, spec), launcher.spans, launcher.config


async def _watched(drive, launcher: Launcher):
    """Await ``drive`` while the launcher's children live; a child that dies or hangs raises ChildFailed."""
    task = asyncio.ensure_future(drive)
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            launcher.check()
    finally:
        task.cancel()
    return task.result()


def total_output(work: Workload | MultiTurn) -> int:
    """Output tokens the whole workload asks for."""
    if isinstance(work, MultiTurn):
        return work.num_users * work.num_turns * work.output_len
    return sum(work.output_lens)


def add_workload_flags(g: argparse._ArgumentGroup) -> None:
    """The flags of the multi-turn and structured workloads (pipeline-bench and scripts/compare_peers.py share them)."""
    g.add_argument("--num-users", type=int, default=16, help="multi-turn: users chatting at once")
    g.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per user")
    g.add_argument(
        "--system-len", type=int, default=600, help="multi-turn: tokens of the system prompt every user shares"
    )
    g.add_argument("--message-len", type=int, default=40, help="multi-turn: tokens of each new user message")
    g.add_argument(
        "--json-share",
        type=float,
        default=0.5,
        help="structured: the share of requests with a JSON-schema response_format (the rest free text)",
    )


def multi_turn(args: argparse.Namespace) -> MultiTurn:
    """The multi-turn workload the flags describe (replies of ``--output-len`` tokens)."""
    return MultiTurn.synth(
        args.num_users, args.num_turns, args.system_len, args.message_len, args.output_len, args.seed
    )


def build_bench_parser() -> argparse.ArgumentParser:
    """``pipeline-serve``'s parser with the benchmark's flags added."""
    p = build_parser()
    p.prog = "pipeline-bench"
    # Its output is its table: no access or stats lines from a server it starts, unless asked for.
    p.set_defaults(disable_uvicorn_access_log=True, log_stats_interval_s=0.0)
    p.description = __doc__.split("\n\n")[0] + " " + " ".join(__doc__.split("\n\n")[1].split())
    g = p.add_argument_group("benchmark")
    g.add_argument(
        "--workload",
        choices=["fixed", "sharegpt-synth", "rewrite", "multi-turn", "structured"],
        default="fixed",
        help="fixed: --batch-size requests of --input-len prompt and --output-len output tokens; "
        "sharegpt-synth: --num-requests with long-tailed lengths; rewrite: --num-requests chat requests "
        "to rewrite a function given in the prompt (where prompt-lookup speculation pays); these arrive "
        "at once (see --concurrency). multi-turn: "
        "--num-users chat for --num-turns turns each in a closed loop, every turn resending a shared "
        "--system-len system prompt and the conversation so far (the server's own replies included) "
        "plus a new --message-len message, replies of --output-len tokens. structured (--http): "
        "--num-requests chat requests, a --json-share of them with a JSON-schema response_format (they end "
        "with their JSON), the others free text, up to --output-len tokens. The others ignore EOS.",
    )
    g.add_argument("--batch-size", type=int, default=64, help="fixed workload: number of requests")
    g.add_argument("--input-len", type=int, default=32, help="fixed workload: prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="fixed and multi-turn workloads: output tokens")
    g.add_argument(
        "--num-requests", type=int, default=200, help="sharegpt-synth, rewrite and structured: number of requests"
    )
    add_workload_flags(g)
    g.add_argument("--seed", type=int, default=0, help="workload seed")
    g.add_argument(
        "--mode",
        choices=["async", "sync", "both"],
        default="both",
        help="scheduling mode(s); both runs async then sync and reports ratios",
    )
    g.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="fixed, sharegpt-synth and rewrite workloads: requests in flight at once, the next sent as "
        "one finishes; several values run one after another on the same workload. Default: every "
        "request at once.",
    )
    g.add_argument(
        "--speculation",
        choices=["on", "off", "both"],
        default="on",
        help="with --speculative-config: run with it (on), without it (off), or both back to back "
        "(each run then labelled spec / no-spec, and their throughput ratio printed)",
    )
    g.add_argument(
        "--http", action="store_true", help="start the whole server and send requests through the OpenAI API"
    )
    g.add_argument("--url", default=None, help="with --http: benchmark a running server instead (no gap figures)")
    g.add_argument(
        "--bound",
        action="store_true",
        help="after each run, replay its exact steps through the bare model forward in this process "
        "(server stopped) and report engine throughput / bound throughput; real model only",
    )
    g.add_argument("--json", metavar="FILE", default=None, help="write the figures per mode here")
    g.add_argument("--plot", metavar="FILE.png", default=None, help="draw gap histograms and a timeline strip")
    return p


def main(argv: list[str] | None = None) -> None:
    """Console entry of ``pipeline-bench``."""
    args = build_bench_parser().parse_args(argv)
    http = args.http or bool(args.url)
    if args.workload == "fixed":
        # Every request of the batch runs at once: give the engine room for it.
        sizes = {
            "max_num_seqs": max(args.max_num_seqs, args.batch_size),
            "max_num_batched_tokens": max(args.max_num_batched_tokens, args.batch_size),
        }
        work = Workload.fixed(args.batch_size, args.input_len, args.output_len, args.seed)
    elif args.workload == "multi-turn":
        work = multi_turn(args)
        sizes = {"max_num_seqs": max(args.max_num_seqs, work.num_users), "max_model_len": args.max_model_len or 2048}
        if work.max_len > sizes["max_model_len"]:
            print(
                f"pipeline-bench: the longest conversation takes {work.max_len} tokens, more than "
                f"--max-model-len {sizes['max_model_len']}: raise it or shorten the workload",
                file=sys.stderr,
            )
            raise SystemExit(2)
    elif args.workload == "sharegpt-synth":
        sizes = {"max_model_len": args.max_model_len or 2048}
        work = Workload.sharegpt_synth(args.num_requests, sizes["max_model_len"], args.seed)
    else:
        from pipeline.common.model_files import resolve_model
        from pipeline.io_proc.tokenization import load_tokenizer

        if args.workload == "structured" and not http:
            print(
                "pipeline-bench: the structured workload's grammars go through the OpenAI API: add --http (or --url)",
                file=sys.stderr,
            )
            raise SystemExit(2)
        sizes = {"max_model_len": args.max_model_len or 2048}
        tokenizer, _ = load_tokenizer(str(resolve_model(None if args.model == "sim" else args.model)[0]))
        if args.workload == "rewrite":
            work = Workload.rewrite(args.num_requests, tokenizer, sizes["max_model_len"], args.seed)
        else:
            work = Workload.structured(args.num_requests, args.json_share, args.output_len, tokenizer)
            sizes["max_num_seqs"] = max(args.max_num_seqs, args.num_requests)
    if args.bound and (args.url or args.model == "sim" or args.data_parallel_size > 1 or args.tensor_parallel_size > 1):
        print(
            "pipeline-bench: --bound replays one engine's steps on one device: it needs a real model run by "
            "this benchmark, without --url, sim, -tp or -dp",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.nnodes > 1:
        print(
            "pipeline-bench: the benchmark runs the server's processes itself, on this machine only: it "
            "takes no --nnodes (benchmark a multi-node server over HTTP with --url)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    unused = {
        "json",
        "plot",
        "trace_file",
        "async_scheduling",
        "bound",
        "concurrency",
        "speculation",
        "json_share",
        *{
            "fixed": ("num_requests", "num_users", "num_turns", "system_len", "message_len"),
            "rewrite": ("batch_size", "input_len", "output_len", "num_users", "num_turns", "system_len", "message_len"),
            "sharegpt-synth": (
                "batch_size",
                "input_len",
                "output_len",
                "num_users",
                "num_turns",
                "system_len",
                "message_len",
            ),
            "multi-turn": ("num_requests", "batch_size", "input_len"),
            "structured": ("batch_size", "input_len", "num_users", "num_turns", "system_len", "message_len"),
        }[args.workload],
    }
    flags = {**{k: v for k, v in vars(args).items() if k not in unused}, **sizes, "http": http}
    modes = {"async": [True], "sync": [False], "both": [True, False]}[args.mode]
    specs = (
        [True]
        if args.speculative_config is None
        else {"on": [True], "off": [False], "both": [True, False]}[args.speculation]
    )
    concurrencies = args.concurrency or [None]
    runs = [(c, sp, a) for c in concurrencies for sp in specs for a in modes]
    trace = args.trace_file
    results, spans = {}, {}
    replay = None
    shapes_dir = tempfile.TemporaryDirectory(prefix="pipeline-bench-") if args.bound else None
    try:
        for c, sp, a in runs:
            label = "async" if a else "sync"
            if c is not None:
                label += f" c={c}"
            if len(specs) == 2:
                label += " spec" if sp else " no-spec"
            tf = trace
            if trace and len(runs) > 1:
                root, ext = os.path.splitext(trace)
                tf = f"{root}.{label.replace(' ', '.').replace('=', '')}{ext or '.json'}"
            config = None
            if not args.url:  # spans are always recorded: the gap figures come from them
                config = make_config(args, **sizes, async_scheduling=a)
                config = msgspec.structs.replace(config, trace=True)
                if not sp:
                    config = msgspec.structs.replace(config, speculative=None)
                if shapes_dir:
                    config = msgspec.structs.replace(
                        config, step_shapes_file=os.path.join(shapes_dir.name, f"{len(results)}.npz")
                    )
            results[label], spans[label], config = run_mode(args, config, http, work, label, tf, c)
            if shapes_dir:
                replay = replay or BoundReplay(config)  # loaded after the first run: nothing else runs now
                bound_s = replay.replay(config.step_shapes_file, label)
                results[label]["bound"] = {"replay_s": bound_s, "engine_over_bound": bound_s / results[label]["wall_s"]}
            results[label]["config"] = {**flags, "concurrency": c, "speculation": sp}
    except (ChildFailed, TimeoutError) as e:
        print(f"pipeline-bench: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if shapes_dir:
            shapes_dir.cleanup()
    print_table(results)
    print_ratios(results)
    if args.json:
        out = dict(results)
        if set(results) == {"async", "sync"}:
            a, s = results["async"], results["sync"]
            out["ratio_async_over_sync"] = {"output_tokens_per_s": a["output_tokens_per_s"] / s["output_tokens_per_s"]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        plot(results, spans, args.plot)
