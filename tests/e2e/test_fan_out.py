"""Fan-out (issue 23, item 7): a bound on sequences per request, and memory that comes back after a large one.

Simulated device; the memory figures measured are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import Server
from tests.e2e.test_faults import role_pid

MAX_SEQS = 16384
LARGE = 65536  # sequences of the request whose memory must come back
FAN_OUT = ["--model", "sim", "--sim-step-us", "1000", "--max-model-len", "256", "--max-num-seqs", "1024"]


@pytest.fixture(scope="module")
def wide(request):
    srv = Server([*FAN_OUT, "--max-num-batched-tokens", "2048", "--max-seqs-per-request", str(MAX_SEQS)])
    request.addfinalizer(srv.stop)
    return srv


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def fan_out(srv: Server, prompts: int, n: int) -> httpx.Response:
    body = {"model": srv.model, "prompt": ["hello there"] * prompts, "n": n, "max_tokens": 2}
    return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=300)


def test_more_sequences_than_the_bound_is_400_naming_the_field(wide):
    r = fan_out(wide, MAX_SEQS // 64 + 1, 64)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and f"at most {MAX_SEQS} per request" in err["message"], err
    r = httpx.post(
        f"{wide.url}/v1/chat/completions",
        timeout=30,
        json={"model": wide.model, "messages": [{"role": "user", "content": "hi"}], "n": 100, "max_tokens": 1},
    )
    assert r.status_code == 200, r.text  # chat asks for n sequences alone
    r = fan_out(wide, 2048, MAX_SEQS // 2048)
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_SEQS


def test_memory_returns_after_a_large_request():
    wide = Server([*FAN_OUT, "--max-num-batched-tokens", "2048", "--max-seqs-per-request", str(LARGE)])
    try:
        _check_memory_returns(wide)
    finally:
        wide.stop()


def _check_memory_returns(wide: Server) -> None:
    fan_out(wide, 16, 2)  # warm-up: what the first requests leave for the next (pools, buffers)
    time.sleep(2)
    pids = {role: role_pid(wide, role) for role in ("io_proc", "scheduler")}
    before = {role: rss_mb(pid) for role, pid in pids.items()}
    assert fan_out(wide, 2048, LARGE // 2048).status_code == 200
    # Within 10 %, or what the allocators keep: after 65,536 sequences the scheduler's Python heap is back
    # within 100 kB (tracemalloc), its RSS 6-13 MB above idle (pools and arenas that the burst's last
    # objects pin, C allocator pages; 13 on a loaded 2-core CI), and a second such burst does not add to it.
    limit = {r: max(before[r] * 1.1, before[r] + 16) for r in pids}
    deadline = time.monotonic() + 30  # on a quiet machine: about a second; CI runs beside other load
    while True:  # given back about a second after the request ends
        after = {role: rss_mb(pid) for role, pid in pids.items()}
        if all(after[r] <= limit[r] for r in pids) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(f"RSS before / after {LARGE} sequences, MB:", {r: (round(before[r]), round(after[r])) for r in pids})
    for role in pids:
        assert after[role] <= limit[role], (role, before[role], after[role])
