"""Two "nodes" on one machine: ``-tp 2`` with rank 1 under a second launcher, over loopback.

Node 0 runs the whole server and rank 0; node 1 (``--node-rank 1``) runs
only rank 1, which gets every step descriptor from rank 0's relay
broadcast. The tokens must equal a single-rank server's, greedy and seeded
(float32, chunked prefill and preemption as in test_tensor_parallel); killing
node 1's launcher under load must stop the head with a clear message, and a
stopped head must stop node 1.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, Server, child_pids, free_port, load_until_generating, shm_entries, tcp_sockets
from tests.e2e.test_async import run_all
from tests.e2e.test_faults import cmdline
from tests.e2e.test_lifecycle import wait_gone
from tests.e2e.test_tensor_parallel import BASE, jobs


def start_two_nodes(model, *flags: str) -> tuple[subprocess.Popen, Server]:
    """Node 1's launcher (ranks only), then the head's server; both with ``flags``."""
    nodes = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "pipeline.launcher", "--model", str(model), *flags, *nodes, "--node-rank", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    try:
        head = Server(["--model", str(model), *flags, *nodes])
    except BaseException:
        node1.kill()
        node1.wait()
        raise
    return node1, head


@pytest.fixture(scope="module")
def reference(tiny_kv4_dir):
    srv = Server(["--model", str(tiny_kv4_dir), *BASE, "--num-kv-blocks", "200", "--no-async-scheduling"])
    try:
        yield asyncio.run(run_all(srv, jobs()))
    finally:
        srv.stop()


def test_two_nodes_equal_tp1(tiny_kv4_dir, reference):
    node1, head = start_two_nodes(tiny_kv4_dir, *BASE, "--num-kv-blocks", "24")
    try:
        out = asyncio.run(run_all(head, jobs()))
        for job, x, y in zip(jobs(), out, reference):
            assert x == y, job
        m = head.wait_idle()
        assert m["pipeline_num_preemptions_total"] > 0
        assert m["pipeline_kv_blocks_free"] == m["pipeline_kv_blocks_total"] == 24
        # Every rank's sockets, the rendezvous store's listener included, are on --master-addr's
        # route (loopback here), not on every address of the machine.
        ranks = [p for p in [*head.children, *child_pids(node1.pid)] if "gpu_worker" in cmdline(p)]
        sockets = [s for p in ranks for s in tcp_sockets(p)]
        assert len(ranks) == 2 and any(listening for _, _, listening in sockets)
        assert {ip for ip, _, _ in sockets} == {"127.0.0.1"}, sockets
    finally:
        head_code = head.stop()
        # The head's rank 0 tells node 1 it stops: node 1 follows, cleanly.
        code = node1.wait(30)
        log = node1.stdout.read()
        assert head_code == 0, f"head:\n{head.output()}\nnode 1:\n{log}"
    assert code == 0, log
    assert "gpu_worker-tp1: the head node stopped; stopping this node" in log, log


def test_killing_node_1_stops_the_head(tiny_kv4_dir):
    node1, head = start_two_nodes(tiny_kv4_dir, *BASE, "--kv-cache-memory", "0.01")
    clients, results = load_until_generating(head, 3, 10)
    node1_ranks = child_pids(node1.pid)
    os.kill(node1.pid, signal.SIGKILL)
    node1.wait(10)
    code = head.proc.wait(30)
    for t in clients:
        t.join(60)
    out = head.output()
    assert code != 0
    assert "gpu_worker: lost the tensor-parallel ranks on another node" in out, out
    assert sum(r != 200 for r in results) >= 3, results  # at least the requests under way failed
    assert wait_gone(head.children + node1_ranks) == []
    assert shm_entries(head.proc.pid) == []


def test_nodes_with_different_settings_refuse_to_start(tiny_kv4_dir):
    nodes = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.launcher",
            "--model",
            str(tiny_kv4_dir),
            *BASE,
            *nodes,
            "--node-rank",
            "1",
            "--max-num-seqs",
            "64",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    with pytest.raises(RuntimeError, match=r"different settings: node 1: max_num_seqs=64 \(head: 256\)"):
        Server(["--model", str(tiny_kv4_dir), *BASE, *nodes])
    assert node1.wait(30) != 0
    assert "max_num_seqs=64 (head: 256)" in node1.stdout.read()
