"""A flag is one field of its config group: the parser, ``--help``, its check and the config every process
receives follow it, with no other edit (the same shape as test_field_tables.py)."""

from __future__ import annotations

import os
from typing import Annotated

import msgspec
import pytest

from pipeline.common import config_groups
from pipeline.common.config_groups import ObservabilityConfig
from pipeline.common.flags import flag, positive
from pipeline.common.model_flags import RESOLVED
from pipeline.server_args import build_parser, group_from_args
from pipeline.server_config import make_config


class ObservabilityWithSampling(ObservabilityConfig, frozen=True):
    """ObservabilityConfig with one more flag, as a new feature would add it."""

    log_sample_rate: Annotated[float, flag("Log one finished request in this many.", check=positive)] = 1.0


def test_a_field_added_to_a_group_reaches_help_check_and_config(monkeypatch, capsys):
    monkeypatch.setitem(config_groups.GROUPS, "observability", ObservabilityWithSampling)
    parser = build_parser()
    text = " ".join(parser.format_help().split())
    assert "--log-sample-rate LOG_SAMPLE_RATE Log one finished request in this many. (default: 1.0)" in text
    assert text.index("observability:") < text.rindex("--log-sample-rate")  # in its group's section

    config = make_config(parser.parse_args(["--model", "sim", "--log-sample-rate", "4"]))
    os.rmdir(config.ipc_dir)
    assert config.observability.log_sample_rate == 4.0
    # What each child reads on its stdin: the group goes only to the processes that read it.
    for kind in ("io_proc", "scheduler"):
        assert b'"log_sample_rate":4.0' in msgspec.json.encode(config.for_process(kind))
    assert config.for_process("gpu_worker").observability is None

    with pytest.raises(SystemExit) as e:
        make_config(parser.parse_args(["--model", "sim", "--log-sample-rate", "0"]))
    assert e.value.code == 2 and "--log-sample-rate must be positive" in capsys.readouterr().err


def test_help_has_a_section_per_group_and_keeps_vllms_short_flags():
    text = build_parser().format_help()
    for title in (*RESOLVED, *config_groups.GROUPS):
        assert f"\n{title}:\n" in text
    assert "-tp TENSOR_PARALLEL_SIZE, --tensor-parallel-size" in text
    assert "-dp DATA_PARALLEL_SIZE, --data-parallel-size" in text


def test_each_group_default_is_its_flags_default():
    """A config built from no flags holds every group's defaults, so a field's default is stated once."""
    args = build_parser().parse_args([])
    for group in (*RESOLVED.values(), *config_groups.GROUPS.values()):
        assert group_from_args(group, args) == group()
