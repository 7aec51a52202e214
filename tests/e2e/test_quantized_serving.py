"""The default model served as its GGUF file holds it (Q4_1 linear weights on the compiled int4 kernel), over HTTP,
and scored by lm-evaluation-harness against the float32 expansion of the same file."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from pipeline.gpu_worker.layers import quant_cpu
from tests.conftest import SMALL, Server
from tests.e2e.lm_eval_task import run_lm_eval, server_loglikelihoods, server_model_args, write_task


@pytest.fixture(scope="module")
def q4_server(request):
    srv = Server(["--quantization", "auto", *SMALL])
    request.addfinalizer(srv.stop)
    return srv


def test_the_default_model_runs_as_q4_1_and_answers(q4_server):
    # The worker's start-up line: every decoder linear layer (30 layers x qkv, o, gate/up, down) holds int4
    # codes in groups of 32 (Q4_1's blocks) on the compiled CPU kernel (torch's where it cannot be built), with
    # two float32 coefficients a group (torch's: bfloat16 scale and zero): 75.9 MiB (63.3) against 405 MiB of
    # float32. The tied LM head multiplies by the file's Q8_0 table: int8 codes in groups of 32, one float32
    # scale a group, 30.4 MiB against 108 MiB (where the kernel is not built, the dense table).
    if quant_cpu.unavailable_reason() is None:
        held = "(int4_panel), 75.9 MiB; LM head: int8 group 32 (int8_panel), 30.4 MiB"
    else:
        held = "(int4_cpu), 63.3 MiB"
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


def test_lm_eval_scores_q4_1_within_0_02_of_the_float32_expansion(q4_server, smol_async, smol_dir, tmp_path):
    # lm-evaluation-harness through the Q4_1 server, each (document, choice)'s loglikelihood against the same
    # file expanded to float32 (smol_async: --quantization none).
    pytest.importorskip("lm_eval")
    write_task(tmp_path)
    _, lls = run_lm_eval(tmp_path, "q4_1", "local-completions", server_model_args(q4_server, smol_dir))
    expanded = server_loglikelihoods(smol_async, AutoTokenizer.from_pretrained(smol_dir))
    assert lls.keys() == expanded.keys()
    for key, ll in lls.items():
        assert abs(ll - expanded[key]) < 0.02, (key, ll, expanded[key])


def test_q4_1_greedy_completions_equal_the_float32_expansions(q4_server, smol_async):
    # In float32 the panel kernel multiplies by each weight as the file dequantizes it, so only the order of the
    # sums differs from the expansion's dense matmul.
    for prompt in ("Write a haiku about the sea.", "Explain recursion in one paragraph.", "Who wrote Hamlet?"):
        texts = []
        for srv in (q4_server, smol_async):
            body = {"model": srv.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 48}
            r = httpx.post(f"{srv.url}/v1/chat/completions", json=body | {"temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["message"]["content"])
        assert texts[0] == texts[1], prompt
