"""Jump-forward: tokens per forward pass of JSON-schema rows, with the grammar's forced tokens as drafts or without.

Starts ``pipeline-serve`` (SmolLM2 by default) with prompt lookup, once per
configuration (jump-forward on and off, async scheduling and lock step), and
sends each the same greedy requests one at a time: a schema of 8 required keys
of short strings and enums, compact (llguidance's ``"x-guidance":
{"whitespace_flexible": false}``: the keys and their punctuation are forced)
and as given (any whitespace between tokens: only keys and enum values are
forced). For each it prints the output tokens, the drafts accepted
(``pipeline_spec_decode_num_accepted_tokens_total``) and tokens per forward
pass, ``tokens / (tokens - accepted)`` (each pass of a row gives one token plus
its accepted drafts), and checks that every configuration gave the same tokens.

    python scripts/bench_jump_forward.py
    python scripts/bench_jump_forward.py --requests 8 -- --model /path/to/model
"""

from __future__ import annotations

import argparse
import json

import httpx
from bench_server import Server

KEYS = ["name", "species", "color", "habitat", "diet", "temperament", "size", "lifespan"]
SCHEMA = {
    "type": "object",
    "properties": {
        k: {"type": "string", "maxLength": 12} if i % 2 == 0 else {"enum": ["small", "medium", "large"]}
        for i, k in enumerate(KEYS)
    },  # fmt: skip
    "required": KEYS,
    "additionalProperties": False,
}
SCHEMAS = {"compact": {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}, "any whitespace": SCHEMA}
ANIMALS = ["cat", "dog", "parrot", "horse", "goldfish", "rabbit", "owl", "lizard"]
CONFIGS = {
    "jump-forward, async": [],
    "lookup only, async": ["--no-grammar-jump-forward"],
    "jump-forward, lock step": ["--no-async-scheduling"],
    "lookup only, lock step": ["--no-grammar-jump-forward", "--no-async-scheduling"],
}
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'


def accepted(srv: Server) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("pipeline_spec_decode_num_accepted_tokens_total"))
    return float(line.split()[-1])


def run(srv: Server, schema: dict, requests: int) -> tuple[list[list[int]], float]:
    """The requests' output tokens, and the drafts accepted while they ran."""
    before = accepted(srv)
    outputs = []
    for animal in ANIMALS[:requests]:
        body = {
            "model": srv.model,
            "messages": [{"role": "user", "content": f"Describe a {animal} as JSON."}],
            "max_tokens": 160,
            "temperature": 0,
            "return_token_ids": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "animal", "schema": schema}},
        }
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        outputs.append(r.json()["choices"][0]["token_ids"])
    return outputs, accepted(srv) - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=4, help="requests per schema, one at a time (at most 8)")
    p.add_argument("--speculative-config", default=SPEC, help="pipeline-serve's --speculative-config")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="more pipeline-serve flags, after --")
    args = p.parse_args()
    flags = [f for f in args.flags if f != "--"]
    results: dict[str, dict[str, tuple[list[list[int]], float]]] = {}
    for label, extra in CONFIGS.items():
        srv = Server(["--speculative-config", args.speculative_config, *extra, *flags])
        try:
            results[label] = {name: run(srv, schema, args.requests) for name, schema in SCHEMAS.items()}
        finally:
            srv.stop()
    print(f"\n{args.requests} greedy requests per schema, one at a time; --speculative-config", args.speculative_config)
    print("| configuration | schema | tokens | accepted | tokens per forward |")
    print("| --- | --- | --- | --- | --- |")
    for label, by_schema in results.items():
        for name, (outputs, acc) in by_schema.items():
            n = sum(len(o) for o in outputs)
            print(f"| {label} | {name} | {n} | {acc:.0f} | {n / (n - acc):.2f} |")
    for name in SCHEMAS:
        same = len({json.dumps(r[name][0]) for r in results.values()}) == 1
        print(f"{name}: {'the same tokens in every configuration' if same else 'TOKENS DIFFER between configurations'}")


if __name__ == "__main__":
    main()
