"""A small multiple-choice task for lm-evaluation-harness, and the ``lm_eval`` command line run on it offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["five", "four", "seven"], "answer": 1},
    {"question": "The sun rises in the", "choices": ["west", "north", "east"], "answer": 2},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Fahrenheit"], "answer": 0},
    {"question": "The opposite of hot is", "choices": ["warm", "cold", "red"], "answer": 1},
    {"question": "A baby cat is called a", "choices": ["puppy", "calf", "kitten"], "answer": 2},
]
TASK = "pipeline_mini_mc"


def write_task(d: Path) -> Path:
    data = d / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (d / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return d


def run_lm_eval(tmp: Path, name: str, model: str, model_args: str, *extra: str) -> tuple[float, dict]:
    """Run the ``lm_eval`` CLI offline; returns (acc, {(doc, choice): loglikelihood})."""
    out = tmp / f"out-{name}"
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp / "datasets-cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        TASK,
        "--include_path",
        str(tmp),
        "--output_path",
        str(out),
        "--log_samples",
        "--batch_size",
        "1",
        *extra,
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    (results,) = out.rglob("results_*.json")
    acc = json.loads(results.read_text())["results"][TASK]["acc,none"]
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    lls = {}
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        for i, resp in enumerate(s["resps"]):
            lls[(s["doc_id"], i)] = float(resp[0][0])  # the samples file stores numbers as strings
    return acc, lls


def server_model_args(server, tokenizer_dir: Path) -> str:
    """``--model_args`` of lm-eval's ``local-completions`` model pointed at the server, prompts as token ids."""
    return (
        f"model={server.model},base_url={server.url}/v1/completions,tokenizer={tokenizer_dir},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1"
    )


def server_loglikelihoods(server, tok) -> dict:
    """Each (document, choice)'s loglikelihood from the server's echoed prompt log-probabilities,
    with lm-eval's split of context and continuation (the continuation is what the whole adds)."""
    out = {}
    for d, doc in enumerate(DOCS):
        for i, choice in enumerate(doc["choices"]):
            context = tok.encode(doc["question"], add_special_tokens=False)
            whole = tok.encode(doc["question"] + " " + choice, add_special_tokens=False)
            r = httpx.post(
                f"{server.url}/v1/completions",
                timeout=300,
                json={"model": server.model, "prompt": whole, "max_tokens": 0, "echo": True, "logprobs": 1},
            )
            assert r.status_code == 200, r.text
            out[(d, i)] = sum(r.json()["choices"][0]["logprobs"]["token_logprobs"][len(context) :])
    return out
