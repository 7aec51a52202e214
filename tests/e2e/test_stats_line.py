"""The periodic stats line: logged under traffic and not when idle, and its figures agree with /metrics."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx

from tests.conftest import Server
from tests.e2e.test_metrics import SIM, scrape, value

INTERVAL = 1.0
LINE = re.compile(
    r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
    r"Running: (\d+) reqs, Waiting: (\d+) reqs, Preemptions: (\d+), KV cache usage: ([\d.]+)%, "
    r"Token gap p50: (\d+ us|-), Device busy: ([\d.]+%|-), Prefix cache hit rate: ([\d.]+)%$"
)


def lines(path) -> list[re.Match]:
    return [m for line in path.read_text().splitlines() if (m := LINE.search(line))]


def intervals(seen: list[re.Match]) -> list[float]:
    """Each line's interval in seconds, from the log's timestamps: a scrape that failed under load
    makes the next line cover two beats. The first line's start was not logged: one beat."""
    t = [datetime.strptime(m.string[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() for m in seen]
    return [INTERVAL, *(b - a for a, b in zip(t, t[1:]))]


def test_stats_line_under_traffic_only_and_agrees_with_metrics(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        srv = Server([*SIM, "--log-stats-interval", str(INTERVAL)], log=f)
    try:
        time.sleep(3 * INTERVAL)
        assert not lines(log), "a stats line while idle"
        before = scrape(srv)
        body = {"model": srv.model, "prompt": "the of and to " * 10, "max_tokens": 400, "ignore_eos": True}
        with ThreadPoolExecutor(4) as pool:
            for r in pool.map(lambda _: httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120), range(4)):
                assert r.status_code == 200
        srv.wait_idle()
        time.sleep(2.5 * INTERVAL)  # the interval with the last tokens is logged
        after = scrape(srv)
        seen = lines(log)
        assert seen, "no stats line under traffic"
        time.sleep(3 * INTERVAL)
        assert len(lines(log)) == len(seen), "stats lines went on while idle"
    finally:
        srv.stop()

    def delta(name):
        return value(after, name) - value(before, name)

    # Each line's rate over its interval adds up to the counters' increase.
    prompt = sum(float(m.group(1)) * dt for m, dt in zip(seen, intervals(seen)))
    generation = sum(float(m.group(2)) * dt for m, dt in zip(seen, intervals(seen)))
    assert abs(prompt - delta("pipeline_prompt_tokens_total")) <= 0.1 * delta("pipeline_prompt_tokens_total") + 1
    assert abs(generation - delta("pipeline_generation_tokens_total")) <= 0.1 * delta(
        "pipeline_generation_tokens_total"
    )
    assert sum(int(m.group(5)) for m in seen) == delta("pipeline_num_preemptions_total")
    assert all(int(m.group(3)) + int(m.group(4)) <= 4 for m in seen)
    assert any(m.group(7) != "-" for m in seen) and any(m.group(8) != "-" for m in seen)
