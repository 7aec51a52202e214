#!/usr/bin/env bash
# GPU checks of issue 12 ("on a GPU no step may wait for the device"), for a CUDA machine.
#
#   bash scripts/gpu_check.sh            # from anywhere; a few minutes on one GPU
#
# Needs .venv from scripts/setup.sh with a CUDA build of torch (install it first; setup.sh
# then leaves it alone), or PYTHON=/path/to/python. Runs, and fails on the first failure:
#   1. the CUDA-marked tests in tests/unit, each with decode CUDA graphs off ("eager") and
#      on ("graphs": captured at start-up, decode-only steps replayed, padded to a size):
#      - ModelRunner.launch() for prefill, decode and mixed steps (greedy, sampled with
#        top-k/top-p/seeds, poison mode on) under torch.cuda.set_sync_debug_mode("error");
#      - a marker event queued behind torch.cuda._sleep is still pending when launch()
#        returns, for greedy, sampled and long-context (3000-token) steps;
#      - captured graphs sample the eager CUDA path's tokens (tests/unit/test_cuda_graphs.py);
#   2. the CPU sync guard and the worker's unit tests, on this machine's torch;
#   3. pipeline-bench on the simulated device at batch 256 (async token gap p50/p99 ~ 0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device visible to torch {torch.__version__}; install a CUDA build of torch")
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name()}")
PYEOF

echo "== 1/3 CUDA tests, graphs off and on: no sync in launch(), marker pending behind _sleep, graphs = eager"
# -rs lists skips; with a visible device none of these may skip, so any skip fails the check.
out=$(timeout 600 "$PY" -m pytest -v -rs -m cuda tests/unit/test_no_host_sync.py tests/unit/test_cuda_graphs.py 2>&1) \
  || { echo "$out"; exit 1; }
echo "$out" | grep -E "PASSED|FAILED" | sed 's/^tests\/unit\///'
echo "$out" | tail -n 1
if echo "$out" | grep -q "skipped"; then echo "gpu_check: CUDA tests were skipped"; exit 1; fi

echo "== 2/3 CPU sync guard and worker unit tests"
timeout 600 "$PY" -m pytest -q tests/unit tests/e2e/test_model.py

echo "== 3/3 simulated-device bench, batch 256"
timeout 300 "$PY" -m pipeline.bench --model sim --sim-step-us 10000 --batch-size 256 --output-len 256 --mode both

echo "gpu_check: all checks passed"
