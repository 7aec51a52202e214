"""The default model served as its GGUF file holds it (Q4_1 linear weights on the compiled int4 kernel), over HTTP."""

from __future__ import annotations

import httpx
import pytest

from pipeline.gpu_worker.layers import quant_cpu
from tests.conftest import SMALL, Server


@pytest.fixture(scope="module")
def q4_server(request):
    srv = Server(["--quantization", "auto", *SMALL])
    request.addfinalizer(srv.stop)
    return srv


def test_the_default_model_runs_as_q4_1_and_answers(q4_server):
    # The worker's start-up line: every decoder linear layer (30 layers x qkv, o, gate/up, down) holds int4
    # codes in groups of 32 (Q4_1's blocks) on the compiled CPU kernel (torch's where it cannot be built), with
    # two float32 coefficients a group (torch's: bfloat16 scale and zero): 75.9 MiB (63.3) against 405 MiB of
    # float32.
    held = "(int4_panel), 75.9 MiB" if quant_cpu.unavailable_reason() is None else "(int4_cpu), 63.3 MiB"
    assert f"linear weights: 120 x int4 group 32 {held}" in q4_server.output()
    body = {
        "model": q4_server.model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    r = httpx.post(f"{q4_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
