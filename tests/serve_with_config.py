"""Run `pipeline-serve` with EngineConfig fields that have no flag yet.

Usage: ``python -m tests.serve_with_config JSON [pipeline-serve flags]``,
where JSON maps ``EngineConfig`` field names to values; they replace what the
flags produced. Used by ``conftest.Server(config=...)``.
"""

from __future__ import annotations

import json
import sys

import msgspec

from pipeline.launcher import Launcher
from pipeline.server_args import build_parser
from pipeline.server_config import make_config


def main() -> None:
    fields = json.loads(sys.argv[1])
    config = msgspec.structs.replace(make_config(build_parser().parse_args(sys.argv[2:])), **fields)
    raise SystemExit(Launcher(config).serve())


if __name__ == "__main__":
    main()
