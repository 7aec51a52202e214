"""Run `pipeline-serve` with EngineConfig fields that have no flag yet.

Usage: ``python -m tests.serve_with_config JSON [pipeline-serve flags]``,
where JSON maps ``EngineConfig`` field names to values, or a group's name
(``"http"``) to some of its fields; they replace what the flags produced.
Used by ``conftest.Server(config=...)``.
"""

from __future__ import annotations

import json
import sys

import msgspec

from pipeline.launcher import Launcher
from pipeline.server_args import build_parser
from pipeline.server_config import make_config


def main() -> None:
    config = make_config(build_parser().parse_args(sys.argv[2:]))
    fields = {
        k: msgspec.structs.replace(getattr(config, k), **v) if isinstance(v, dict) else v
        for k, v in json.loads(sys.argv[1]).items()
    }
    raise SystemExit(Launcher(msgspec.structs.replace(config, **fields)).serve())


if __name__ == "__main__":
    main()
