"""/metrics: vLLM's request histograms, the runtime's own clocks, and vLLM's names under --metrics-compat vllm.

A simulated device of fixed 2 ms steps serves a known sequence of requests
(plain, streamed, with a stop token, a stop string and ``n`` = 2); each
histogram's count is the number of finished choices (inter-token latency:
their tokens after the first), its sum lies within what the client measured,
and one request at a time shows TTFT <= e2e for each. The vLLM names are
checked against the list from vLLM's documentation, and every query of
vLLM's stock Grafana dashboard is evaluated on two scrapes.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.common.step_clock import CPU_SAMPLE_EVERY
from tests.conftest import Server

DATA = Path(__file__).resolve().parent.parent / "data"
STEP_S = 0.002
SIM = ["--model", "sim", "--sim-step-us", "2000", "--max-num-batched-tokens", "64", "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def server(request):
    srv = Server([*SIM, "--metrics-compat", "vllm", "--served-model-name", "sim-model"])
    request.addfinalizer(srv.stop)
    return srv


def scrape(srv: Server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: ``(name, sorted label items) -> value``."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{srv.url}/metrics", timeout=10).text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m[(name, tuple(sorted(labels.items())))]


def hist(m: dict, name: str) -> tuple[float, float]:
    """(count, sum) of an unlabelled pipeline_ histogram."""
    return value(m, f"{name}_count"), value(m, f"{name}_sum")


def request(srv: Server, stream: bool, **body) -> dict:
    """One completion; returns usage, finish reasons and the client's timings (send to first text / to end)."""
    body = {"model": srv.model, "prompt": "the of and to", "max_tokens": 20, "ignore_eos": True, **body}
    t0 = time.perf_counter()
    if not stream:
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        j = r.json()
        return {"usage": j["usage"], "n": len(j["choices"]), "e2e": time.perf_counter() - t0, "ttft": None}
    first, usage, n = None, None, set()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                n.add(c["index"])
                if c["text"] and first is None:
                    first = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    return {"usage": usage, "n": len(n), "e2e": time.perf_counter() - t0, "ttft": first}


REQUEST_HISTOGRAMS = (
    "pipeline_time_to_first_token_seconds",
    "pipeline_e2e_request_latency_seconds",
    "pipeline_request_time_per_output_token_seconds",
    "pipeline_request_queue_time_seconds",
    "pipeline_request_prefill_time_seconds",
    "pipeline_request_decode_time_seconds",
    "pipeline_request_inference_time_seconds",
    "pipeline_request_prompt_tokens",
    "pipeline_request_generation_tokens",
    "pipeline_request_params_max_tokens",
)


def test_request_histograms_count_and_bound_a_known_sequence(server):
    plain = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": server.model, "prompt": "the of and to", "max_tokens": 20, "ignore_eos": True,
              "return_token_ids": True},
        timeout=60,
    ).json()["choices"][0]  # fmt: skip
    server.wait_idle()
    before = scrape(server)
    cases = [
        (False, {"max_tokens": 5}),
        (True, {"max_tokens": 12}),
        (False, {"stop_token_ids": [plain["token_ids"][6]]}),  # ends on its 7th token (or earlier repeat)
        (True, {"stop": [plain["text"][plain["text"].index(" ", 1)]], "max_tokens": 20}),  # a stop string
        (False, {"max_tokens": 8, "n": 2}),
        (True, {"max_tokens": 1}),
    ]
    results = [request(server, stream, **body) for stream, body in cases]
    after = server.wait_idle()
    after = scrape(server)

    choices = sum(r["n"] for r in results)
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    prompt_tokens = sum(r["usage"]["prompt_tokens"] * r["n"] for r in results)
    d = {name: [a - b for a, b in zip(hist(after, name), hist(before, name))] for name in REQUEST_HISTOGRAMS}
    for name in REQUEST_HISTOGRAMS:
        assert d[name][0] == choices, name
    itl_count, itl_sum = (a - b for a, b in zip(hist(after, "pipeline_inter_token_latency_seconds"),
                                                  hist(before, "pipeline_inter_token_latency_seconds")))  # fmt: skip
    assert itl_count == tokens - choices  # every token after each choice's first
    n_count, n_sum = (a - b for a, b in zip(hist(after, "pipeline_request_params_n"),
                                              hist(before, "pipeline_request_params_n")))  # fmt: skip
    assert (n_count, n_sum) == (len(cases), choices)
    assert d["pipeline_request_generation_tokens"][1] == tokens
    assert d["pipeline_request_prompt_tokens"][1] == prompt_tokens
    # Sums within what the client saw: the server's intervals lie inside the client's.
    client_e2e = sum(r["e2e"] * r["n"] for r in results)
    assert tokens * STEP_S * 0.99 <= d["pipeline_e2e_request_latency_seconds"][1] <= client_e2e
    assert d["pipeline_time_to_first_token_seconds"][1] <= d["pipeline_e2e_request_latency_seconds"][1]
    # Each token after a choice's first took at least one 2 ms step.
    assert (tokens - choices) * STEP_S * 0.99 <= itl_sum <= client_e2e
    # Both sides time decode on the engine's step times: the same figure.
    assert d["pipeline_request_decode_time_seconds"][1] == pytest.approx(itl_sum, abs=1e-6)
    assert d["pipeline_request_inference_time_seconds"][1] == pytest.approx(
        d["pipeline_request_prefill_time_seconds"][1] + d["pipeline_request_decode_time_seconds"][1], abs=1e-6
    )
    assert (
        value(after, "pipeline_generation_tokens_total") - value(before, "pipeline_generation_tokens_total") == tokens
    )
    # vLLM's names carry the same figures.
    for name in REQUEST_HISTOGRAMS:
        vllm = name.replace("pipeline_", "vllm:")
        assert value(after, f"{vllm}_count", model_name="sim-model", engine="0") == hist(after, name)[0]


def test_ttft_within_e2e_for_every_request(server):
    """One request at a time, so each histogram's increase is that request's value."""
    for stream, body in [(True, {"max_tokens": 3}), (True, {"max_tokens": 15}), (False, {"max_tokens": 9})]:
        server.wait_idle()
        before = scrape(server)
        r = request(server, stream, **body)
        after = scrape(server)

        def delta(name, after=after, before=before):
            return hist(after, name)[1] - hist(before, name)[1]

        ttft, e2e = delta("pipeline_time_to_first_token_seconds"), delta("pipeline_e2e_request_latency_seconds")
        queue, prefill = delta("pipeline_request_queue_time_seconds"), delta("pipeline_request_prefill_time_seconds")
        assert 0 < ttft <= e2e <= r["e2e"]
        if r["ttft"] is not None:
            assert ttft <= r["ttft"]
        # The engine's first-token interval lies inside io_proc's.
        assert 0 <= queue + prefill <= ttft
        assert e2e >= body["max_tokens"] * STEP_S * 0.99


def test_runtime_clocks(server):
    server.wait_idle()
    before = scrape(server)
    request(server, False, max_tokens=120, n=4)
    server.wait_idle()
    after = scrape(server)
    steps = value(after, "pipeline_num_steps_total") - value(before, "pipeline_num_steps_total")
    busy = value(after, "pipeline_device_busy_seconds_total") - value(before, "pipeline_device_busy_seconds_total")
    assert busy == pytest.approx(steps * STEP_S, rel=1e-6)  # every simulated step lasts 2 ms
    gaps = hist(after, "pipeline_token_gap_seconds")[0] - hist(before, "pipeline_token_gap_seconds")[0]
    assert steps - 2 <= gaps <= steps  # all but the steps that only start new requests
    for process in ("scheduler", "gpu_worker", "io_proc"):  # one step in CPU_SAMPLE_EVERY
        count = value(after, "pipeline_step_cpu_seconds_count", process=process)
        sampled = count - value(before, "pipeline_step_cpu_seconds_count", process=process)
        assert (steps - 3) // CPU_SAMPLE_EVERY - 1 <= sampled <= steps // CPU_SAMPLE_EVERY + 1, process
    assert 0 < value(after, "pipeline_step_cpu_seconds_sum", process="gpu_worker")


def read_list() -> dict[str, tuple[str, frozenset]]:
    out = {}
    for line in (DATA / "vllm_metric_names.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, kind, labels = line.split()
            out[name] = (kind, frozenset(labels.split(",")))
    return out


# vLLM metrics of features this server does not have (yet); the rest must all be exported.
NOT_EXPORTED = {
    "vllm:engine_sleep_state",  # no sleep mode
    "vllm:external_prefix_cache_queries_total",  # no KV connector
    "vllm:external_prefix_cache_hits_total",
    "vllm:mm_cache_queries_total",  # no multi-modal input
    "vllm:mm_cache_hits_total",
    "vllm:spec_decode_num_drafts_total",  # no speculative decoding yet
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
}


def test_vllm_names_and_labels_match_vllms_list(server):
    listed = read_list()
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    exported: dict[str, tuple[str, frozenset]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        for s in family.samples:
            base = s.name if family.type == "counter" else family.name
            if s.name.endswith("_created"):
                continue
            labels = frozenset(s.labels) - {"le"}
            exported.setdefault(base, (family.type, labels))
            assert exported[base] == (family.type, labels), s
    for name, got in exported.items():
        assert name in listed, f"{name} is not one of vLLM's metrics"
        assert got == listed[name], name
    assert set(exported) == set(listed) - NOT_EXPORTED
    # Off by default: a server without the flag has none of them.
    plain = Server(SIM)
    try:
        assert "vllm:" not in httpx.get(f"{plain.url}/metrics", timeout=10).text
    finally:
        plain.stop()


_SELECTOR = re.compile(r"(vllm:[a-z0-9_]+)\{([^}]*)\}")


def _select(samples: dict, name: str, matchers: str) -> dict[tuple, float]:
    want = dict(re.findall(r'(\w+)="([^"]*)"', matchers))
    return {
        labels: v
        for (n, labels), v in samples.items()
        if n == name and all(dict(labels).get(k) == val for k, val in want.items())
    }


def _quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over cumulative ``{le: count}``."""
    les = sorted(buckets)
    total = buckets[les[-1]]
    if total == 0:
        return math.nan
    rank, prev_le, prev = q * total, 0.0, 0.0
    for le in les:
        if buckets[le] >= rank:
            if le == math.inf:
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev) / (buckets[le] - prev)
        prev_le, prev = le, buckets[le]
    return math.nan


def evaluate(query: str, before: dict, after: dict, seconds: float) -> list[float]:
    """The values of one dashboard query over the interval between two scrapes (the forms the dashboard uses)."""

    def rate(name, matchers, per_second=True):
        a, b = _select(after, name, matchers), _select(before, name, matchers)
        return {k: (v - b.get(k, 0.0)) / (seconds if per_second else 1.0) for k, v in a.items()}

    if m := re.fullmatch(r"histogram_quantile\(([\d.]+), sum by\(le\) \(rate\((.+)\[\$__rate_interval\]\)\)\)", query):
        name, matchers = _SELECTOR.fullmatch(m.group(2)).groups()
        buckets: dict[float, float] = {}
        for labels, v in rate(name, matchers).items():
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + v
        return [_quantile(float(m.group(1)), buckets)] if buckets else []
    if m := re.fullmatch(r"sum by\((\w+)\) \(increase\((.+)\[\$__rate_interval\]\)\)", query):
        name, matchers = _SELECTOR.fullmatch(m.group(2)).groups()
        groups: dict[str, float] = {}
        for labels, v in rate(name, matchers, per_second=False).items():
            groups[dict(labels)[m.group(1)]] = groups.get(dict(labels)[m.group(1)], 0.0) + v
        return list(groups.values())
    rates = re.findall(r"rate\((.+?)\[\$__rate_interval\]\)", query)
    if rates:
        series = [rate(*_SELECTOR.fullmatch(r).groups()) for r in rates]
        if len(series) == 1:
            return list(series[0].values())
        num, den = series
        return [num[k] / den[k] for k in num if den.get(k)]
    name, matchers = _SELECTOR.fullmatch(query).groups()
    return list(_select(after, name, matchers).values())


def test_stock_vllm_grafana_dashboard_queries_work_unchanged(server):
    queries = [
        q.replace("$model_name", server.model)
        for q in (DATA / "vllm_grafana_queries.txt").read_text().splitlines()
        if q and not q.startswith("#")
    ]
    assert len(queries) == 27
    server.wait_idle()
    before, t0 = scrape(server), time.monotonic()
    results = [request(server, i % 2 == 0, max_tokens=10 + 5 * i) for i in range(4)]
    server.wait_idle()
    after, seconds = scrape(server), time.monotonic() - t0
    for q in queries:
        values = evaluate(q, before, after, seconds)
        assert values and all(math.isfinite(v) for v in values), q
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    rate_q = queries[6]
    assert "generation_tokens_total" in rate_q
    assert evaluate(rate_q, before, after, seconds) == [pytest.approx(tokens / seconds)]
    p50 = queries[3]
    assert "e2e" in p50 and "0.5" in p50
    # The estimate interpolates within vLLM's buckets: at most the bound above the slowest request.
    assert 0 < evaluate(p50, before, after, seconds)[0] <= 0.5 or max(r["e2e"] for r in results) > 0.3
