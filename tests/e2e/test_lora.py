"""LoRA adapters through the real server: vLLM's flags and endpoints, greedy tokens equal to peft's merged
models through transformers, mixed batches, the prefix cache kept apart per adapter, adapters waiting for
a slot, and bad adapters refused while the server keeps serving.

A tiny random Llama base; adapters made with peft (random B: peft starts it at zero) on different
target-module sets and ranks, each also merged into a full model that ``tests.reference`` runs.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import peft
import pytest
import torch
import transformers

from tests.conftest import Server, make_tiny_llama
from tests.reference import assert_same_greedy, hf_greedy

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (r, lora_alpha, use_rslora, target_modules)
ADAPTERS = {
    "a": (8, 16, False, ALL),
    "b": (4, 8, True, ["q_proj", "v_proj", "down_proj"]),
    "c": (8, 4, False, ["o_proj", "gate_proj", "up_proj"]),
}
NEW_TOKENS = 16
PROMPT = list(range(1000, 1040))  # 40 tokens: two full blocks of 16 to cache


def make_adapter(base_dir, out_dir, merged_dir, spec, seed: int) -> None:
    r, alpha, rslora, targets = spec
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(out_dir)
    model.merge_and_unload().save_pretrained(merged_dir)
    for f in base_dir.iterdir():  # the tokenizer, for the reference's loader
        if "token" in f.name:
            shutil.copy(f, merged_dir / f.name)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer_dir) -> dict:
    """ "base" and each adapter name -> (adapter dir, merged model dir); "base" -> (base dir, base dir)."""
    base = make_tiny_llama(tmp_path_factory.mktemp("lora-base"), tokenizer_dir)
    out = {"base": (base, base)}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        d, merged = tmp_path_factory.mktemp(f"lora-{name}"), tmp_path_factory.mktemp(f"lora-{name}-merged")
        make_adapter(base, d, merged, spec, seed=i + 1)
        out[name] = (d, merged)
    return out


def serve(dirs, *extra: str) -> Server:
    base = dirs["base"][0]
    return Server(
        [
            "--model", str(base), "--served-model-name", "base", "--enable-lora",
            "--lora-modules", f"a={dirs['a'][0]}", json.dumps({"name": "b", "path": str(dirs["b"][0])}),
            "--max-loras", "2", "--max-lora-rank", "8", "--allow-runtime-lora-updating",
            "--kv-cache-memory", "0.25", "--max-model-len", "512", "--max-num-batched-tokens", "32",
            "--debug-token-cache-poison", "--metrics-compat", "vllm", "--enable-log-requests", *extra,
        ]
    )  # fmt: skip


@pytest.fixture(scope="module", params=["async", "sync"])
def server(request, dirs):
    srv = serve(dirs, *([] if request.param == "async" else ["--no-async-scheduling"]))
    request.addfinalizer(srv.stop)
    return srv


def complete(server, model: str, prompt: list[int], max_tokens: int = NEW_TOKENS) -> dict:
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=120,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def tokens(server, model: str, prompt: list[int]) -> list[int]:
    return complete(server, model, prompt)["choices"][0]["token_ids"]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_models_lists_each_adapter_with_the_base_as_parent(server, dirs):
    cards = {m.id: m for m in openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").models.list().data}
    assert {k: (v.parent, v.root) for k, v in cards.items() if k != "base"} == {
        "a": ("base", str(dirs["a"][0])),
        "b": ("base", str(dirs["b"][0])),
    }
    assert cards["base"].parent is None


def test_a_mixed_batch_gives_each_request_its_solo_output_and_peft_s(server, dirs):
    """Rows (base, a, b, a) in the same steps: each gets what it gets alone, and what peft's merged model
    generates."""
    models = ["base", "a", "b", "a"]
    prompts = [PROMPT[i : i + 9 + 5 * i] for i in range(len(models))]
    with ThreadPoolExecutor(len(models)) as pool:
        mixed = list(pool.map(lambda mp: tokens(server, *mp), zip(models, prompts, strict=True)))
    for model, prompt, got in zip(models, prompts, mixed, strict=True):
        assert tokens(server, model, prompt) == got
        merged = str(dirs[model][1])
        assert_same_greedy(merged, prompt, got, hf_greedy(merged, prompt, NEW_TOKENS))
    assert mixed[1] != mixed[3] or prompts[1] == prompts[3]
    assert len({tuple(t) for t in mixed}) == len(mixed)


def test_the_openai_sdk_names_an_adapter_and_an_unknown_name_is_404(server, dirs):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
    got = client.completions.create(model="b", prompt=PROMPT[:12], max_tokens=NEW_TOKENS, temperature=0)
    merged = str(dirs["b"][1])
    ref = hf_greedy(merged, PROMPT[:12], NEW_TOKENS)
    assert got.choices[0].text == transformers.AutoTokenizer.from_pretrained(merged).decode(ref)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_lora_requests_info_and_the_request_log_name_the_adapters(server):
    """vLLM's gauge shows a running adapter's name while its request runs; the request log names it."""
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(complete, server, "b", PROMPT[:5], 200)
        seen = ""
        while not long.done() and 'running_lora_adapters="b"' not in seen:
            seen = httpx.get(f"{server.url}/metrics").text
        long.result()
    assert re.search(
        r'vllm:lora_requests_info\{max_lora="2",running_lora_adapters="b",waiting_lora_adapters=""\} ', seen
    )
    idle = httpx.get(f"{server.url}/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in idle
    assert "lora_adapter='b', prompt_tokens=5," in server.output()


def test_identical_prompts_on_two_adapters_never_share_prefix_cache_blocks(server):
    prompt = [p + 1 for p in PROMPT]  # not sent by another test

    def cached(model):
        return complete(server, model, prompt, 1)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("a") == 0
    assert cached("a") == 32  # its own blocks are reused
    assert cached("b") == 0
    assert cached("base") == 0
    assert cached("b") == 32


def test_runtime_load_serve_unload_and_more_adapters_than_slots_wait(server, dirs):
    """c is loaded at run time: three adapters over two slots all run, concurrently, with their own weights;
    then c is unloaded (404 after), and loaded again under the same name with another adapter's weights."""
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(dirs["c"][0])}).text == (
        "Success: LoRA adapter 'c' added successfully."
    )
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(dirs["c"][0])})
    assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"]
    models = ["a", "b", "c", "c", "b", "a"]
    prompts = [PROMPT[i : i + 12] for i in range(len(models))]
    with ThreadPoolExecutor(len(models)) as pool:
        got = list(pool.map(lambda mp: tokens(server, *mp), zip(models, prompts, strict=True)))
    for model, prompt, out in zip(models, prompts, got, strict=True):
        merged = str(dirs[model][1])
        assert_same_greedy(merged, prompt, out, hf_greedy(merged, prompt, NEW_TOKENS))
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 404
    gone = httpx.post(f"{server.url}/v1/completions", json={"model": "c", "prompt": "hi", "max_tokens": 2})
    assert gone.status_code == 404
    # The name again, now with b's weights: none of c's weights or cached blocks are used.
    body = {"lora_name": "c", "lora_path": str(dirs["b"][0])}
    assert post(server, "/v1/load_lora_adapter", body).status_code == 200
    merged = str(dirs["b"][1])
    assert_same_greedy(merged, prompts[2], tokens(server, "c", prompts[2]), hf_greedy(merged, prompts[2], NEW_TOKENS))
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200


def test_bad_adapters_are_refused_naming_the_cause_and_the_server_keeps_serving(server, dirs, tmp_path):
    def refused(path, name="bad") -> str:
        r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    assert "not a PEFT LoRA adapter" in refused(tmp_path / "missing")
    assert "conflicts with a served base model" in refused(dirs["a"][0], "base")
    high = tmp_path / "high-rank"
    shutil.copytree(dirs["a"][0], high)
    cfg = json.loads((high / "adapter_config.json").read_text())
    (high / "adapter_config.json").write_text(json.dumps({**cfg, "r": 16}))
    assert "rank 16 is over --max-lora-rank 8" in refused(high)
    unknown = tmp_path / "unknown"
    shutil.copytree(dirs["a"][0], unknown)
    (unknown / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "lm_head"]}))
    assert "target modules ['lm_head'] are not served" in refused(unknown)
    other = tmp_path / "other-base"
    shutil.copytree(dirs["a"][0], other)
    (other / "adapter_config.json").write_text(json.dumps({**cfg, "r": 4}))  # B's shapes then need r 4
    assert "trained for another base model" in refused(other)
    assert "bad" not in {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    # The adapter is read at its load: its files may go after.
    gone = tmp_path / "gone"
    shutil.copytree(dirs["a"][0], gone)
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(gone)}).status_code == 200
    shutil.rmtree(gone)
    assert tokens(server, "gone", PROMPT[:8]) == tokens(server, "a", PROMPT[:8])
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "gone"}).status_code == 200


def test_an_adapter_the_worker_cannot_read_fails_its_request_alone(server, dirs):
    """The server's prepared copy of an adapter removed before the worker first reads it: that request ends
    with an OpenAI-style error naming the cause; a request beside it, and the worker, go on."""
    assert (
        post(server, "/v1/load_lora_adapter", {"lora_name": "lost", "lora_path": str(dirs["a"][0])}).status_code == 200
    )
    copies = glob.glob(f"{tempfile.gettempdir()}/pipeline-{server.proc.pid}-*/lora-*.safetensors")
    os.unlink(max(copies, key=os.path.getmtime))
    with ThreadPoolExecutor(2) as pool:
        beside = pool.submit(tokens, server, "base", PROMPT[:10])
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "lost", "prompt": PROMPT[:6], "max_tokens": 4})
        assert r.status_code == 500 and "could not read its LoRA adapter" in r.json()["error"]["message"], r.text
        assert beside.result() == tokens(server, "base", PROMPT[:10])
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "lost"}).status_code == 200
    assert len(tokens(server, "a", PROMPT[:8])) == NEW_TOKENS


def test_a_bad_lora_module_stops_the_start_up_naming_it(dirs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(dirs["a"][0], bad)
    (bad / "adapter_model.safetensors").unlink()
    with pytest.raises(RuntimeError, match=r"--lora-modules x: .* is not a PEFT LoRA adapter"):
        Server(["--model", str(dirs["base"][0]), "--enable-lora", "--lora-modules", f"x={bad}"], timeout=60)


def test_the_response_names_the_adapter_asked_for(server):
    """As vLLM answers: ``model`` is the adapter's name, streamed or not; the base model's name without one."""
    assert complete(server, "a", PROMPT[:6], 2)["model"] == "a"
    assert complete(server, "base", PROMPT[:6], 2)["model"] == "base"
    body = {"model": "b", "prompt": PROMPT[:6], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"b"}


def test_unload_and_reload_while_requests_stream_never_mixes_weights(server, dirs):
    """Streams of a, b, x and y run while x and y are unloaded and loaded again, over two slots: every answer
    equals its adapter's solo answer (x is always c's weights, y always b's), and a name not loaded is 404."""
    weights = {"x": "c", "y": "b"}
    for name, src in weights.items():
        assert (
            post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(dirs[src][0])}).status_code
            == 200
        )
    prompts = [PROMPT[i : i + 8 + i % 5] for i in range(8)]
    models = ["a", "b", "x", "y"]
    solo = {(m, i): tokens(server, m, p) for m in models for i, p in enumerate(prompts)}
    assert solo["y", 0] == solo["b", 0] and solo["x", 0] != solo["a", 0]
    done = threading.Event()

    def stream(k: int) -> list[tuple[str, int, int, list[int] | None]]:
        seen, j = [], 0
        while not done.is_set() or j < 4:
            m, i = models[(k + j) % len(models)], (k * 3 + j) % len(prompts)
            body = {"model": m, "prompt": prompts[i], "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{server.url}/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
            seen.append((m, i, r.status_code, r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None))
            j += 1
        return seen

    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream, k) for k in range(4)]
        for _ in range(3):
            for name, src in weights.items():
                assert post(server, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
                time.sleep(0.05)
                body = {"lora_name": name, "lora_path": str(dirs[src][0])}
                assert post(server, "/v1/load_lora_adapter", body).status_code == 200
        done.set()
        seen = [s for f in streams for s in f.result()]
    for m, i, status, got in seen:
        assert status == 200 or (status == 404 and m in weights), (m, status)
        assert got is None or got == solo[m, i], (m, i)
    assert sum(status == 200 and m in weights for m, _, status, _ in seen) >= 4
    for name in weights:
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_n_logprobs_and_structured_output_with_adapters(server):
    """Beside rows of other adapters: greedy ``n=2`` gives its solo answer twice, log-probabilities equal the
    solo ones, and a JSON schema's answer equals the solo one and keeps to the schema."""
    lp = {"model": "a", "prompt": PROMPT[:9], "max_tokens": 8, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    n2 = {"model": "b", "prompt": PROMPT[:7], "max_tokens": 8, "temperature": 0, "n": 2, "ignore_eos": True}
    colors = ["red", "green", "blue", "yellow", "purple"]
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"enum": colors}}}
    so = {"model": "a", "messages": [{"role": "user", "content": "A color."}], "max_tokens": 12, "temperature": 0}
    so["response_format"] = fmt
    jobs = [("completions", lp), ("completions", n2), ("chat/completions", so), ("completions", {**lp, "model": "b"})]

    def send(job):
        r = httpx.post(f"{server.url}/v1/{job[0]}", json=job[1], timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"]

    with ThreadPoolExecutor(len(jobs)) as pool:
        mixed = list(pool.map(send, jobs))
    alone = [send(j) for j in jobs]
    for got, want in zip(mixed[:2] + mixed[3:], alone[:2] + alone[3:], strict=True):
        assert [c["text"] for c in got] == [c["text"] for c in want]
    assert mixed[1][0]["text"] == mixed[1][1]["text"]
    for got, want in ((mixed[0][0], alone[0][0]), (mixed[3][0], alone[3][0])):
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
    assert mixed[0][0]["logprobs"]["token_logprobs"] != pytest.approx(mixed[3][0]["logprobs"]["token_logprobs"])
    assert mixed[2][0]["message"]["content"] == alone[2][0]["message"]["content"]
    assert json.loads(mixed[2][0]["message"]["content"]) in colors


@pytest.fixture(scope="module")
def spec_server(request, dirs):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    srv = serve(dirs, "--speculative-config", json.dumps(spec), "--speculative-policy", "always")
    request.addfinalizer(srv.stop)
    return srv


def test_speculation_verifies_drafts_with_the_request_s_adapter(spec_server, dirs):
    """Prompt-lookup drafts, proposed without the adapter and verified with it: a mixed batch's greedy tokens,
    drafts verified on the way, are peft's merged models' (those without speculation). (A random model's
    output seldom repeats its context, so its drafts are mostly rejected: each correction token is sampled
    from the verifying pass, which therefore ran with the row's adapter.)"""
    models = ["base", "a", "b", "a"]
    prompts = [PROMPT[i : i + 6] * 4 for i in range(len(models))]  # repeats for the lookup to find
    n = 24
    drafted = spec_server.metrics().get("pipeline_spec_decode_num_draft_tokens_total", 0)
    with ThreadPoolExecutor(len(models)) as pool:
        mixed = list(
            pool.map(lambda mp: complete(spec_server, *mp, n)["choices"][0]["token_ids"], zip(models, prompts))
        )
    for model, prompt, got in zip(models, prompts, mixed, strict=True):
        merged = str(dirs[model][1])
        assert_same_greedy(merged, prompt, got, hf_greedy(merged, prompt, n))
    assert spec_server.metrics()["pipeline_spec_decode_num_draft_tokens_total"] > drafted
