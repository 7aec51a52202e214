"""Request logs: uvicorn's access lines by default, one line per request with --enable-log-requests, and the
prompt only with --log-prompts."""

from __future__ import annotations

import re
import time

import httpx

from tests.conftest import Server
from tests.e2e.test_metrics import SIM

SECRET = "zebra quartz violin"


def run(tmp_path, *flags: str) -> tuple[str, list[dict]]:
    """Serve two requests (one streamed) with ``flags``; return the server's log and the responses' ids and usage."""
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        srv = Server([*SIM, "--log-stats-interval", "0", *flags], log=f)
    try:
        body = {"model": srv.model, "prompt": SECRET, "max_tokens": 6, "ignore_eos": True, "n": 2}
        plain = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()
        chat = {"model": srv.model, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 4}
        with httpx.stream(
            "POST", f"{srv.url}/v1/chat/completions", json={**chat, "stream": True}, timeout=60
        ) as r:  # fmt: skip
            # Read to the end: closing the stream early would abort the request.
            streamed_id = next(line for line in list(r.iter_lines()) if line.startswith("data: {"))
        time.sleep(0.5)
    finally:
        srv.stop()
    streamed = {"id": re.search(r'"id":"([^"]+)"', streamed_id).group(1)}
    return log.read_text(), [plain, streamed]


def request_line(text: str, request_id: str) -> str:
    lines = [line for line in text.splitlines() if f"pipeline.requests INFO: {request_id}:" in line]
    assert len(lines) == 1, text
    return lines[0]


def seconds(line: str, name: str) -> float:
    return float(re.search(rf"{name}=([\d.]+)s", line).group(1))


def test_access_lines_and_request_lines_without_prompts(tmp_path):
    text, (plain, streamed) = run(tmp_path, "--enable-log-requests")
    assert re.search(r'"POST /v1/completions HTTP/1\.1" 200', text), text
    assert re.search(r'"POST /v1/chat/completions HTTP/1\.1" 200', text), text
    line = request_line(text, plain["id"])
    assert f"prompt_tokens={plain['usage']['prompt_tokens']}," in line
    assert "n=2, stream=False, max_tokens=6" in line and "stop_token_ids" not in line  # ignore_eos
    assert "finish_reason=['length', 'length'], completion_tokens=[6, 6]" in line
    assert 0 < seconds(line, "ttft") <= seconds(line, "e2e")
    line = request_line(text, streamed["id"])
    assert "stream=True, max_tokens=4" in line and "completion_tokens=4" in line
    assert SECRET not in text and "zebra" not in text  # never the prompt without --log-prompts


def test_no_access_lines_and_prompts_when_asked(tmp_path):
    text, (plain, streamed) = run(tmp_path, "--disable-uvicorn-access-log", "--enable-log-requests", "--log-prompts")
    assert "HTTP/1.1" not in text, text
    assert f'prompt=["{SECRET}"]' in request_line(text, plain["id"])
    assert f'"content":"{SECRET}"' in request_line(text, streamed["id"])
