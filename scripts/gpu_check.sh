#!/usr/bin/env bash
# The GPU check: on one CUDA GPU, in under 8 minutes, the cuda-marked tests and the benchmarks of
# the real forward pass, one summary table at the end (scripts/gpu_check.py lists the stages).
#
#   bash scripts/fetch_gpu_wheels.sh      # here, once: what the lent GPU machine lacks, into .gpu-carry/
#   bash scripts/gpu_check.sh             # there, with .gpu-carry carried; summary and traces in $OUT
#   bash scripts/gpu_check.sh --dry-run   # anywhere: every step that needs no CUDA, on the CPU
#
# Python: $PYTHON, else .venv/bin/python (scripts/setup.sh), else python3 (the GPU machine's, with
# CUDA torch). The wheels in .gpu-carry/wheels go into a temporary directory on PYTHONPATH, without
# their dependencies (the machine has those) and without the project, which runs from this tree:
# pyproject.toml's torch requirement never touches the machine's CUDA build. Results go to $OUT
# (default ./gpu-check-out); further flags go to gpu_check.py (--budget SECONDS, --stages a,b).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n ${PYTHON:-} ]]; then PY=$PYTHON; elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
out=${OUT:-gpu-check-out}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
site=()
if [[ " $* " != *" --dry-run "* && -d .gpu-carry/wheels ]]; then
  # A failure here is not the end: the deps stage then names what is missing, the summary still comes.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" .gpu-carry/wheels/*.whl \
    || echo "gpu_check: installing .gpu-carry/wheels failed"
  export PYTHONPATH="$PYTHONPATH:$work/site"
  site=(--site "$work/site")
fi
"$PY" scripts/gpu_check.py --work "$work" --out "$out" "${site[@]}" "$@" 2>&1 | tee "$out/gpu_check.log"
