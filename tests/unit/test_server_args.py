"""pipeline-serve flags that are parsed beyond argparse's types."""

from __future__ import annotations

import os

import pytest

from pipeline.server_args import build_parser, make_config, parse_cpu_list


def test_cpu_lists():
    assert parse_cpu_list("", "--worker-cpus") == ()
    assert parse_cpu_list("0", "--worker-cpus") == (0,)
    if len(os.sched_getaffinity(0)) >= 2:
        assert parse_cpu_list("1,0", "--worker-cpus") == (0, 1)
        assert parse_cpu_list("0-1", "--worker-cpus") == (0, 1)


@pytest.mark.parametrize("text", ["a", "0-x", "1-", ",", "99999"])
def test_bad_cpu_lists_exit_with_a_message(text, capsys):
    with pytest.raises(SystemExit):
        parse_cpu_list(text, "--worker-cpus")
    assert "--worker-cpus" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "-tp", "2"],
            "--node-rank 2 is not a node",
        ),
        (["--node-rank", "-1"], "--node-rank -1 is not a node"),
        (["--nnodes", "0"], "--nnodes must be positive"),
        (["--nnodes", "2", "--master-addr", "127.0.0.1", "-tp", "3"], "--nnodes 2 does not divide"),
        (["--nnodes", "2", "-tp", "2"], "needs --master-addr"),
        (["--nnodes", "2", "--master-addr", "h", "--master-port", "70000", "-tp", "2"], "is not a TCP port"),
        (["--nnodes", "2", "--master-addr", "h", "-tp", "2", "-dp", "2"], "does not combine with --data-parallel"),
    ],
)
def test_bad_node_combinations_exit_with_a_message(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        make_config(build_parser().parse_args(["--model", "sim", *flags]))
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_node_layout():
    """Node 1 of 2 at -tp 4 runs ranks 2 and 3, meets at the head's TCP store and has no ring to read."""
    args = ["--model", "sim", "-tp", "4", "--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "1234"]
    head = make_config(build_parser().parse_args(args))
    node1 = make_config(build_parser().parse_args([*args, "--node-rank", "1"]))
    assert (head.is_head, list(head.local_ranks), head.ranks_per_node) == (True, [0, 1], 2)
    assert (node1.is_head, list(node1.local_ranks)) == (False, [2, 3])
    assert node1.tp_init_method == "tcp://10.0.0.1:1234"
    assert [node1.device_index(r) for r in node1.local_ranks] == [0, 1]
    one = make_config(build_parser().parse_args(["--model", "sim", "-tp", "4"]))
    assert one.tp_init_method.startswith("file://") and list(one.local_ranks) == [0, 1, 2, 3]
    for c in (head, node1, one):
        os.rmdir(c.ipc_dir)
