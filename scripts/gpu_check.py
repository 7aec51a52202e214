"""The GPU check: test the CUDA path and measure it in one run on one GPU, and print one summary table.

Run by scripts/gpu_check.sh, which installs the carried wheels first. Each stage is a command with
its own time limit, all within ``--budget`` seconds; a stage that fails or hangs (its processes
are then killed) is marked so and the run goes on to the next, and to the summary:

  deps         the interpreter meets pyproject.toml's requirements and the carried wheels' (gpu_carry.py)
  carry        .gpu-carry/ holds every wheel the machine needs
  model        a Llama-3.2-1B-shaped model, random bfloat16 weights, built on the GPU (gpu_model.py)
  cuda-tests   the cuda-marked tests: no host sync in launch(), launch() returns while the device is
               busy, captured CUDA graphs give the eager path's tokens; a skip fails the stage
  bench-B-graphs, bench-B-eager   pipeline-bench on the model, bfloat16, B requests (256, 64, 1) of
               32 prompt and 256 output tokens, async then lock step, CUDA graphs on / --enforce-eager;
               max_model_len 512 (the graphs' attention covers every row's whole block table)
  profile      a torch.profiler timeline of 20 decode steps at batch 64 (gpu_profile.py)
  http-64      bench-64-graphs through the OpenAI API: 64 streams
  spec-ngram   the rewrite workload (64 requests), -tp 1, prefix caching on, n-gram speculation on and off

The figures: token gap p50/p99, device-busy fraction, output tokens/s, each process's CPU per
step, async ÷ lock step tok/s. Written to OUT: gpu_check.log (by gpu_check.sh), summary.json
(every stage's status and figures), profile-decode-b64.json.gz, trace-b64.{async,sync}.json (the
step timeline of bench-64-graphs, device spans from CUDA events); open the traces in Perfetto.

``--dry-run`` runs, on a machine without CUDA, what needs none: the scripts' syntax, every GPU
stage's flags parsed, the wheel set, the requirements met here, the 1B config read as the server
reads it and its parameters counted, and the tiny variant of each command that runs (model
build, the cuda-marked tests, which skip, a bench run, the profile) on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gpu_carry  # noqa: E402  (a sibling script, not a package)

PY = sys.executable
CUDA_TESTS = ["tests/unit/test_no_host_sync.py", "tests/unit/test_cuda_graphs.py"]
BATCHES = (256, 64, 1)
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
# Every bench: bfloat16 and a fixed KV cache (16 GiB holds 256 requests of 2048 tokens many times over).
BENCH = [PY, "-m", "pipeline.bench", "--dtype", "bfloat16", "--kv-cache-memory", "16"]
FIXED = ["--workload", "fixed", "--input-len", "32", "--output-len", "256", "--max-model-len", "512"]
KILL_GRACE_S = 10
MIN_STAGE_S = 15  # a stage given less than this is not started


@dataclass
class Stage:
    name: str
    argv: list[str]
    timeout_s: float
    needs_model: bool = False
    json: Path | None = None  # pipeline-bench's figures
    junit: Path | None = None  # pytest's counts
    env: dict[str, str] = field(default_factory=dict)
    ok_codes: tuple[int, ...] = (0,)
    skips_fail: bool = False  # a skipped test fails the stage


@dataclass
class Paths:
    work: Path
    out: Path
    tokenizer: Path
    site: Path | None = None

    @property
    def model(self) -> Path:
        return self.work / "llama-1b"


def cuda_tests(p: Paths, on_gpu: bool) -> Stage:
    """The cuda-marked tests; on a GPU none may skip, elsewhere they all do."""
    junit = p.work / "cuda-tests.xml"
    argv = [PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda", f"--junit-xml={junit}"]
    env = {"PIPELINE_TEST_TOKENIZER_DIR": str(p.tokenizer)}
    return Stage("cuda-tests", argv + CUDA_TESTS, 240, junit=junit, env=env, skips_fail=on_gpu)


def gpu_stages(p: Paths) -> list[Stage]:
    """The GPU run's stages, most wanted first (a run cut short by its budget keeps those)."""
    model = str(p.model)
    verify = [PY, str(SCRIPTS / "gpu_carry.py"), "verify"] + ([str(p.site)] if p.site else [])
    stages = [
        Stage("deps", verify, 120),
        Stage("carry", [PY, str(SCRIPTS / "gpu_carry.py"), "check"], 60),
        Stage(
            "model",
            [PY, str(SCRIPTS / "gpu_model.py"), model, "--tokenizer", str(p.tokenizer), "--device", "cuda"],
            180,
        ),
        cuda_tests(p, on_gpu=True),
    ]
    for batch in BATCHES:
        for graphs in (True, False):
            name = f"bench-{batch}-{'graphs' if graphs else 'eager'}"
            flags = [*FIXED, "--batch-size", str(batch), "--mode", "both", "--json", str(p.work / f"{name}.json")]
            flags += [] if graphs else ["--enforce-eager"]
            if batch == 64 and graphs:
                flags += ["--trace", str(p.out / "trace-b64.json")]
            stages.append(Stage(name, [*BENCH, "--model", model, *flags], 120, True, p.work / f"{name}.json"))
        if batch == 256:
            profile = [PY, str(SCRIPTS / "gpu_profile.py"), model, str(p.out / "profile-decode-b64.json.gz")]
            stages.append(Stage("profile", [*profile, "--batch", "64", "--steps", "20"], 150, True))
    http = [*BENCH, "--model", model, *FIXED, "--batch-size", "64", "--mode", "both", "--http"]
    stages.append(Stage("http-64", [*http, "--json", str(p.work / "http-64.json")], 150, True, p.work / "http-64.json"))
    spec = [*BENCH, "--model", model, "--workload", "rewrite", "--num-requests", "64", "--max-model-len", "2048"]
    spec += ["-tp", "1", "--enable-prefix-caching", "--speculative-config", SPEC, "--speculation", "both"]
    spec += ["--mode", "async", "--json", str(p.work / "spec-ngram.json")]
    stages.append(Stage("spec-ngram", spec, 180, True, p.work / "spec-ngram.json"))
    return stages


def dry_stages(p: Paths) -> list[Stage]:
    """What ``--dry-run`` runs on a CPU: the GPU stages that need no CUDA, and tiny versions of the others."""
    tiny = str(p.work / "tiny")
    cpu = ["--device", "cpu", "--attention-backend", "torch_bucketed"]  # no kernel build: the GPU run has none either
    bench = [PY, "-m", "pipeline.bench", "--model", tiny, *cpu, "--kv-cache-memory", "0.25", "--max-model-len", "512"]
    bench += ["--batch-size", "2", "--input-len", "8", "--output-len", "4", "--mode", "async"]
    profile = [PY, str(SCRIPTS / "gpu_profile.py"), tiny, str(p.work / "profile.json.gz"), *cpu]
    return [
        Stage("syntax", ["bash", "-c", "bash -n scripts/gpu_check.sh && bash -n scripts/fetch_gpu_wheels.sh"], 30),
        Stage("deps", [PY, str(SCRIPTS / "gpu_carry.py"), "verify"], 120),
        Stage("carry", [PY, str(SCRIPTS / "gpu_carry.py"), "check"], 60, ok_codes=(0, 2)),
        Stage(
            "model-1b",
            [PY, str(SCRIPTS / "gpu_model.py"), str(p.model), "--tokenizer", str(p.tokenizer), "--meta"],
            120,
        ),
        Stage("model", [PY, str(SCRIPTS / "gpu_model.py"), tiny, "--tokenizer", str(p.tokenizer), "--tiny"], 120),
        cuda_tests(p, on_gpu=False),
        Stage("bench", [*bench, "--json", str(p.work / "bench.json")], 180, True, p.work / "bench.json"),
        Stage("profile", [*profile, "--batch", "4", "--warmup", "1", "--steps", "3"], 120, True),
    ]


def parse_flags(stages: list[Stage]) -> list[str]:
    """Parse each GPU stage's flags with its own parser; the errors found."""
    import gpu_model
    import gpu_profile

    from pipeline.bench.cli import build_bench_parser

    parsers = {"gpu_model.py": gpu_model.parser, "gpu_profile.py": gpu_profile.parser}
    errors = []
    for s in stages:
        if s.argv[1:3] == ["-m", "pipeline.bench"]:
            parser, args = build_bench_parser(), s.argv[3:]
        elif Path(s.argv[1]).name in parsers:
            parser, args = parsers[Path(s.argv[1]).name](), s.argv[2:]
        else:
            continue
        parser.exit_on_error = False
        try:
            _, extra = parser.parse_known_args(args)
            errors += [f"{s.name}: unrecognized {' '.join(extra)}"] if extra else []
        except argparse.ArgumentError as e:
            errors.append(f"{s.name}: {e}")
        except SystemExit:  # argparse reported it on stderr
            errors.append(f"{s.name}: its flags do not parse")
    return errors


def kill_tree(proc: subprocess.Popen) -> None:
    """End a stage's process and every process it started (the server's children have their own groups)."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for q in procs:
            try:
                q.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        if not psutil.wait_procs(procs, timeout=KILL_GRACE_S)[1]:
            return


def run_stage(s: Stage, limit_s: float) -> dict:
    """Run one stage within ``limit_s``; its status, seconds and a detail."""
    print(f"\n== {s.name} (limit {limit_s:.0f} s): {' '.join(s.argv)}", flush=True)
    t0 = time.monotonic()
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1", **s.env}
    proc = subprocess.Popen(s.argv, cwd=ROOT, env=env)
    try:
        rc = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        return {"status": "TIMED OUT", "seconds": time.monotonic() - t0, "detail": f"killed after {limit_s:.0f} s"}
    record = {
        "status": "ok" if rc in s.ok_codes else "FAILED",
        "seconds": time.monotonic() - t0,
        "detail": f"exit {rc}",
    }
    if s.name == "carry" and rc == 2:
        record.update(status="not fetched", detail="run scripts/fetch_gpu_wheels.sh")
    if s.junit is not None and s.junit.is_file():
        suite = next(ET.parse(s.junit).getroot().iter("testsuite"))
        n, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        record["detail"] = f"{n - skipped - bad} passed, {bad} failed, {skipped} skipped"
        if n == 0 or (s.skips_fail and skipped):
            record["status"] = "FAILED"
    if s.json is not None and record["status"] == "ok":
        record["figures"] = json.loads(s.json.read_text())
    return record


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def figure_rows(stages: dict[str, dict]) -> list[list[str]]:
    """One row per benchmark run: token gap, busy fraction, tok/s, CPU per step of each process."""
    rows = []
    for name, rec in stages.items():
        figures = rec.get("figures") or {}
        for label, r in figures.items():
            if label == "ratio_async_over_sync":
                continue
            gap = r["token_gap_us"] or {}
            cpu = r["cpu_per_step_us"]
            ratio = figures.get("ratio_async_over_sync", {}).get("output_tokens_per_s") if label == "async" else None
            rows.append(
                [
                    name,
                    label,
                    _f(gap.get("p50"), ".0f"),
                    _f(gap.get("p99"), ".0f"),
                    _f(r["device_busy_fraction"], ".3f"),
                    _f(r["output_tokens_per_s"], ".0f"),
                    " / ".join(
                        _f(cpu.get(role, {}).get("p50"), ".0f") for role in ("scheduler", "gpu_worker", "io_proc")
                    ),
                    _f(ratio, ".2f"),
                ]
            )
    return rows


def table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in [head, *rows]]
    return "\n".join([lines[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *lines[1:]])


def probe_device() -> dict:
    """torch's version and the GPU's name, in a child process (this one never holds a CUDA context)."""
    code = (
        "import json, torch; ok = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
        "'cuda': ok, 'device': torch.cuda.get_device_name() if ok else 'cpu'}))"
    )
    return json.loads(subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="run what needs no CUDA, on this machine")
    ap.add_argument("--work", type=Path, required=True, help="a scratch directory (the model is built there)")
    ap.add_argument("--out", type=Path, required=True, help="where the summary and the traces go")
    ap.add_argument("--site", type=Path, default=None, help="where gpu_check.sh installed the carried wheels")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all the stages together")
    ap.add_argument("--stages", default=None, help="comma-separated stage names to run (default: all)")
    args = ap.parse_args()
    t0 = time.monotonic()
    tokenizer = gpu_carry.TOKENIZER
    if not (tokenizer / "tokenizer.json").is_file():
        if not args.dry_run:
            print("gpu_check: no .gpu-carry/tokenizer: run scripts/fetch_gpu_wheels.sh where the package index is")
            return 1
        tokenizer = gpu_carry.default_tokenizer_dir()  # a CI run has the default model but fetches nothing
    paths = Paths(args.work, args.out, tokenizer, args.site)
    device = probe_device()
    print(f"gpu_check: torch {device['torch']}, {device['device']}, tokenizer from {tokenizer}", flush=True)
    if not args.dry_run and not device["cuda"]:
        print("gpu_check: no CUDA device visible to torch; --dry-run checks what needs none")
        return 1
    stages = dry_stages(paths) if args.dry_run else gpu_stages(paths)
    wanted = set(args.stages.split(",")) if args.stages else {s.name for s in stages}
    if any(s.needs_model and s.name in wanted for s in stages):
        wanted.add("model")
    results: dict[str, dict] = {}
    if args.dry_run:
        bad = [str(f) for f in sorted(SCRIPTS.glob("gpu_*.py")) if not _compiles(f)]
        errors = bad + parse_flags(gpu_stages(paths))
        results["flags"] = {"status": "FAILED" if errors else "ok", "seconds": 0.0, "detail": "; ".join(errors)}
        results["flags"]["detail"] = results["flags"]["detail"] or "every GPU stage's flags parse; the scripts compile"
    deadline = t0 + args.budget
    for s in stages:
        left = deadline - time.monotonic()
        if s.name not in wanted:
            continue
        if s.needs_model and results.get("model", {}).get("status") != "ok":
            results[s.name] = {"status": "not run", "seconds": 0.0, "detail": "no model"}
        elif left < MIN_STAGE_S:
            results[s.name] = {"status": "not run", "seconds": 0.0, "detail": f"budget of {args.budget:.0f} s spent"}
        else:
            results[s.name] = run_stage(s, min(s.timeout_s, left))
    print(f"\n== summary: {device['device']}, torch {device['torch']}, {time.monotonic() - t0:.0f} s")
    print(
        table(
            ["stage", "status", "s", "detail"],
            [[n, r["status"], f"{r['seconds']:.0f}", r["detail"]] for n, r in results.items()],
        )
    )
    rows = figure_rows(results)
    if rows:
        head = [
            "stage",
            "run",
            "gap p50 µs",
            "gap p99 µs",
            "busy",
            "tok/s",
            "CPU/step p50 µs sched / worker / io",
            "async÷sync tok/s",
        ]
        print("\n" + table(head, rows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({"device": device, "stages": results}, indent=1))
    return 0 if all(r["status"] in ("ok", "not fetched") for r in results.values()) else 1


def _compiles(path: Path) -> bool:
    try:
        compile(path.read_text(), str(path), "exec")
    except SyntaxError as e:
        print(f"gpu_check: {e}")
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
