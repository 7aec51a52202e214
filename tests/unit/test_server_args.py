"""pipeline-serve flags that are parsed beyond argparse's types."""

from __future__ import annotations

import os

import pytest

from pipeline.server_args import parse_cpu_list


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
