"""Fixtures: models on disk, a real `pipeline-serve` in a subprocess, the HF reference."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def tcp_sockets(pid: int) -> list[tuple[str, int, bool]]:
    """``(local address, local port, listening)`` of every TCP socket process ``pid`` holds (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[9] in inodes:
                    addr, port = fields[1].split(":")
                    raw = bytes.fromhex(addr)  # 32-bit words in host (little-endian) order
                    ip = socket.inet_ntop(family, b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
                    ip = ip.removeprefix("::ffff:")  # an IPv4 address on an IPv6 socket
                    out.append((ip, int(port, 16), fields[3] == "0A"))
    return out


def shm_entries(launcher_pid: int) -> list[str]:
    """Shared-memory segments and semaphores of the server whose launcher is ``launcher_pid``."""
    return [f for f in os.listdir("/dev/shm") if f"pipeline-{launcher_pid}-" in f]


class Server:
    """A running `pipeline-serve` subprocess.

    Args:
        args: pipeline-serve flags (``--port`` is added, and ``--quantization none`` unless they set it: the
            tests compare the default model's tokens with transformers' float32 expansion of its GGUF file).
        timeout: seconds to wait for ``/health``.
        config: ``EngineConfig`` fields to set that have no flag (see
            ``tests/serve_with_config.py``).
        log: a file for the server's output (default: a pipe, read only if it fails to start).
        api_key: the key the server was given with ``--api-key``, for the start-up model query.
    """

    def __init__(
        self, args: list[str], timeout: float = 180.0, config: dict | None = None, log=None, api_key: str | None = None
    ):
        self.port = free_port()
        if "--quantization" not in args:
            args = [*args, "--quantization", "none"]
        if config:
            self.args = [
                sys.executable,
                "-m",
                "tests.serve_with_config",
                json.dumps(config),
                "--port",
                str(self.port),
                *args,
            ]
        else:
            self.args = [sys.executable, "-m", "pipeline.launcher", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            self.args, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO
        )
        # The pipe is drained as the server writes (access lines, stats lines), so it never fills and blocks it.
        self._output: list[str] = []
        self._drain = threading.Thread(target=self._output.extend, args=(self.proc.stdout,), daemon=True)
        if log is None:
            self._drain.start()
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                out = self.output() if self.proc.stdout else "(see its log file)"
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{out}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                out = self.output() if self.proc.stdout else "(see its log file)"
                raise RuntimeError(f"server did not become healthy in {timeout:g} s:\n{out}")
            time.sleep(0.3)
        self.children = child_pids(self.proc.pid)
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = httpx.get(f"{self.url}/v1/models", headers=auth).json()["data"][0]["id"]

    def output(self) -> str:
        """What the server printed (without a log file); all of it once it has exited."""
        if self.proc.poll() is not None and self._drain.is_alive():
            self._drain.join(30)
        return "".join(self._output)

    def metrics(self) -> dict[str, float]:
        """The ``pipeline_*`` samples of ``/metrics``.

        Raises:
            RuntimeError: the server has exited (with what it printed).
        """
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=10).text
        except httpx.ConnectError as e:
            try:
                self.proc.wait(5)  # refused: it is stopping, or stopped
            except subprocess.TimeoutExpired:
                raise e from None
            raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}") from None
        out = {}
        for line in text.splitlines():
            if line.startswith("pipeline_"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Wait until no request runs and every block and req_index is back; return the metrics then.

        Frees wait for the last step in flight (deferred free), so they lag
        the requests' end by up to a step; a leak shows as a timeout here
        and then a failed assertion in the caller.
        """
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (
                m["pipeline_num_requests_running"] == 0
                and m["pipeline_num_requests_waiting"] == 0
                and m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"]
                and m["pipeline_req_indices_free"] == m["pipeline_req_indices_total"]
            ):
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def load_until_generating(
    server: Server,
    clients: int,
    min_tokens: int,
    timeout: float = 60.0,
) -> tuple[list[threading.Thread], list[object]]:
    """Start ``clients`` threads that each post ``clients`` long completions, and return once the server
    has generated ``min_tokens`` tokens. Returns the threads and their results (status codes or errors)."""
    results: list[object] = []

    def load() -> None:
        body = {"model": server.model, "prompt": "the of and " * 30, "max_tokens": 150, "ignore_eos": True}
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for _ in range(clients):
                try:
                    results.append(c.post("/v1/completions", json=body).status_code)
                except httpx.HTTPError as e:
                    results.append(e)

    threads = [threading.Thread(target=load) for _ in range(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    while server.metrics().get("pipeline_generation_tokens_total", 0) < min_tokens:
        assert time.monotonic() < deadline, "no tokens generated"
        time.sleep(0.1)
    return threads, results


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """SmolLM2-135M-Instruct converted to a Hugging Face directory (cached across runs)."""
    from pipeline.common.model_files import convert_gguf, default_model_path

    return convert_gguf(default_model_path())


def make_tiny_llama(d: Path, smol_dir: Path, **fields) -> Path:
    """Save a tiny random Llama with SmolLM2's tokenizer in ``d``; ``fields`` override the config."""
    from transformers import LlamaConfig

    return make_tiny_model(d, smol_dir, LlamaConfig, **fields)


def make_tiny_model(d: Path, smol_dir: Path, config_cls, **fields) -> Path:
    """Save a tiny random model of ``config_cls``'s family with SmolLM2's tokenizer (and vocabulary) in ``d``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(smol_dir)
    cfg = config_cls(
        **{
            **dict(
                vocab_size=len(tok),
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=1024,
                initializer_range=0.2,
                bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id,
                tie_word_embeddings=True,
            ),
            **fields,
        }
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tokenizer_dir(request) -> Path:
    """SmolLM2's tokenizer: ``$PIPELINE_TEST_TOKENIZER_DIR`` if set (a directory of its tokenizer files alone,
    which scripts/gpu_check.sh carries to a GPU machine that cannot take the 94 MB GGUF), else ``smol_dir``."""
    carried = os.environ.get("PIPELINE_TEST_TOKENIZER_DIR")
    return Path(carried) if carried else request.getfixturevalue("smol_dir")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer, built in seconds."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_kv4_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """Like ``tiny_dir`` with 8 attention heads over 4 KV heads: splits over 2 or 4 tensor-parallel ranks."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama-kv4"), tokenizer_dir, num_attention_heads=8, num_key_value_heads=4
    )


def _server(request, args):
    srv = Server(args)
    request.addfinalizer(srv.stop)
    return srv


SMALL = ["--kv-cache-memory", "0.25", "--max-model-len", "1024", "--debug-token-cache-poison"]


@pytest.fixture(scope="session")
def tiny_async(request, tiny_dir):
    return _server(request, ["--model", str(tiny_dir), "--max-num-batched-tokens", "32", *SMALL])


@pytest.fixture(scope="session")
def tiny_sync(request, tiny_dir):
    return _server(
        request, ["--model", str(tiny_dir), "--max-num-batched-tokens", "32", "--no-async-scheduling", *SMALL]
    )


@pytest.fixture(scope="session")
def smol_async(request, smol_dir):
    return _server(request, ["--model", str(smol_dir), "--served-model-name", "smol", *SMALL])


@pytest.fixture(scope="session")
def smol_sync(request, smol_dir):
    return _server(request, ["--model", str(smol_dir), "--served-model-name", "smol", "--no-async-scheduling", *SMALL])


HERMES_TEMPLATE = REPO / "tests" / "fixtures" / "hermes_tool_chat_template.jinja"
# Tool calling with a template that renders tools (tests/fixtures), and a small Responses store.
TOOLS = [
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--chat-template",
    str(HERMES_TEMPLATE),
    "--responses-store-max-entries",
    "4",
]


@pytest.fixture(scope="session")
def smol_tools(request, smol_dir):
    """SmolLM2 served with the Hermes tool template and parser, ``auto`` on, a Responses store of 4."""
    return _server(request, ["--model", str(smol_dir), "--served-model-name", "smol", *TOOLS, *SMALL])


@pytest.fixture(scope="session")
def smol_auto(request, smol_dir):
    """SmolLM2 with its own template, which ignores tools, and ``auto`` on with the hermes parser; request logs on."""
    auto = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-log-requests"]
    return _server(request, ["--model", str(smol_dir), "--served-model-name", "smol", *auto, *SMALL])


SIM = [
    "--model",
    "sim",
    "--sim-step-us",
    "1000",
    "--max-num-batched-tokens",
    "32",
    "--max-model-len",
    "1024",
    "--debug-token-cache-poison",
]


@pytest.fixture(scope="session")
def sim_async(request):
    return _server(request, SIM)


@pytest.fixture(scope="session")
def sim_sync(request):
    return _server(request, [*SIM, "--no-async-scheduling"])
