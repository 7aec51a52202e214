#!/usr/bin/env bash
# Regenerate the README's performance figures into docs/perf/ (about 35 minutes on 2 cores).
#
#   bash scripts/perf_figures.sh                        # every figure
#   VLLM_PYTHON=../vllm-venv/bin/python bash scripts/perf_figures.sh   # vLLM's CPU build as a peer too
#   bash scripts/perf_figures.sh sim                    # only the simulated-device tables
#   bash scripts/perf_figures.sh spec                   # only the speculative-decoding tables
#   bash scripts/perf_figures.sh spec-sim               # only speculation on the simulated device
#   bash scripts/perf_figures.sh structured             # only structured output (JSON schema beside free text)
#
# Each table compares figures measured in one invocation (async vs lock step, engine vs bound,
# pipeline vs its peers): machines differ 2-3x in absolute speed, and a busy machine changes
# everything at once, so run it on an otherwise idle machine and compare the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BENCH=("$PY" -m pipeline.bench)
OUT=docs/perf
ONLY=${1:-all}
mkdir -p "$OUT"

run() {  # run NAME CMD...: the table to OUT/NAME.txt, the command on its first line
  local name=$1; shift
  echo "== $name: $*"
  { echo "\$ $*"; "$@" 2>/dev/null; } | tee "$OUT/$name.txt"
}

if [[ $ONLY == all || $ONLY == sim ]]; then
  # The token gap with 10 ms and 2 ms steps at batch 256 and 1024 (simulated device: host overhead only).
  for bs in 256 1024; do
    run "sim-$bs" "${BENCH[@]}" --model sim --sim-step-us 10000 --batch-size "$bs" --output-len 256 --mode both \
      --json "$OUT/sim-$bs.json" --plot "$OUT/sim-$bs.png"
    run "sim-2ms-$bs" "${BENCH[@]}" --model sim --sim-step-us 2000 --batch-size "$bs" --output-len 256 \
      --mode both --json "$OUT/sim-2ms-$bs.json"
  done
fi

if [[ $ONLY == all || $ONLY == model ]]; then
  # SmolLM2-135M on the CPU: async vs lock step, and engine vs the bare model replaying the same steps.
  run smollm2-sharegpt "${BENCH[@]}" --workload sharegpt-synth --num-requests 64 --mode both --bound \
    --json "$OUT/smollm2-sharegpt.json"
  run smollm2-http-64 "${BENCH[@]}" --http --batch-size 64 --input-len 150 --output-len 150 --mode both --bound \
    --json "$OUT/smollm2-http-64.json"
  # Peers on the same workload, one after another.
  peers=(--workload sharegpt-synth --num-requests 64 --json "$OUT/peers-sharegpt.json")
  [[ -n ${VLLM_PYTHON:-} ]] && peers+=(--vllm-python "$VLLM_PYTHON")
  run peers-sharegpt "$PY" scripts/compare_peers.py "${peers[@]}"
  # Multi-turn chat (16 users x 4 turns, 600-token shared system prompt): prefix caching on and off, and peers.
  peers=(--workload multi-turn --num-users 16 --num-turns 4 --system-len 600 --message-len 40 --output-len 48
    --peers pipeline-async,pipeline-no-cache,pipeline-sync,transformers,vllm --json "$OUT/peers-multi-turn.json")
  [[ -n ${VLLM_PYTHON:-} ]] && peers+=(--vllm-python "$VLLM_PYTHON")
  run peers-multi-turn "$PY" scripts/compare_peers.py "${peers[@]}"
  # Single-turn traffic: caching on against off, paired (each round runs both).
  run prefix-cache-single-turn "$PY" scripts/compare_peers.py --workload sharegpt-synth --num-requests 64 \
    --peers pipeline-async,pipeline-no-cache --repeat 3 --json "$OUT/prefix-cache-single-turn.json"
  run cpu-placement "$PY" scripts/compare_cpu_placement.py --workload fixed --batch-size 64 --input-len 150 \
    --output-len 150
fi

if [[ $ONLY == all || $ONLY == spec ]]; then
  # Speculative decoding (prompt lookup), on and off at concurrency 1, 4, 16 and 64 in one invocation each:
  # where it pays (requests that rewrite code given in the prompt) and where it should not cost (sharegpt-synth).
  spec='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
  run spec-rewrite "${BENCH[@]}" --workload rewrite --num-requests 64 --concurrency 1 4 16 64 --mode async \
    --speculative-config "$spec" --speculation both --json "$OUT/spec-rewrite.json"
  run spec-sharegpt "${BENCH[@]}" --workload sharegpt-synth --num-requests 64 --concurrency 1 4 16 64 --mode async \
    --speculative-config "$spec" --speculation both --json "$OUT/spec-sharegpt.json"
  # The same settings in vLLM's CPU build, where its n-gram speculation runs.
  if [[ -n ${VLLM_PYTHON:-} ]]; then
    for c in 1 4; do
      run "peers-spec-rewrite-c$c" "$PY" scripts/compare_peers.py --workload rewrite --num-requests 16 \
        --concurrency "$c" --peers pipeline-async,vllm --speculative-config "$spec" --vllm-python "$VLLM_PYTHON" \
        --json "$OUT/peers-spec-rewrite-c$c.json"
    done
  fi
fi
if [[ $ONLY == all || $ONLY == spec || $ONLY == spec-sim ]]; then
  spec='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
  # The simulated device with speculation: the token gap at 10, 4 and 2 ms steps, with and without drafts
  # in one invocation (six at 2 ms, where the host work of drafting shows and one machine's runs spread most).
  for run_name in 10000us 4000us 2000us-1 2000us-2 2000us-3 2000us-4 2000us-5 2000us-6; do
    run "spec-sim-$run_name" "${BENCH[@]}" --model sim --sim-step-us "${run_name%%us*}" --batch-size 256 \
      --output-len 1024 --mode async --speculative-config "$spec" --speculation both --json "$OUT/spec-sim-$run_name.json"
  done
  # The same on one CPU (taskset): how the drafts' host work fares as the cores the three processes share
  # go from two to one.
  for run_name in 4000us 2000us; do
    run "spec-sim-1cpu-$run_name" taskset -c 0 "${BENCH[@]}" --model sim --sim-step-us "${run_name%%us*}" \
      --batch-size 256 --output-len 1024 --mode async --speculative-config "$spec" --speculation both \
      --json "$OUT/spec-sim-1cpu-$run_name.json"
  done
  # The host work on the path from an output to the next launch, in one thread, with and without drafts:
  # over the run, and over its last 80 steps, where with drafts the requests end at different steps.
  run host-chain "$PY" scripts/bench_host_chain.py --runs 4
  run host-chain-tail "$PY" scripts/bench_host_chain.py --runs 4 --tail 80
fi
if [[ $ONLY == all || $ONLY == structured ]]; then
  # Structured output: 16 streams, half of them JSON-schema constrained, async against lock step (and vLLM),
  # paired rounds; then all 16 constrained against none (the share of the free pace the grammars keep).
  peers=(--workload structured --num-requests 16 --json-share 0.5 --output-len 128 --repeat 2
    --peers pipeline-async,pipeline-sync,vllm --json "$OUT/structured-mixed.json")
  [[ -n ${VLLM_PYTHON:-} ]] && peers+=(--vllm-python "$VLLM_PYTHON")
  run structured-mixed "$PY" scripts/compare_peers.py "${peers[@]}"
  for share in 1 0; do
    run "structured-share-$share" "$PY" scripts/compare_peers.py --workload structured --num-requests 16 \
      --json-share "$share" --output-len 128 --peers pipeline-async,pipeline-sync \
      --json "$OUT/structured-share-$share.json"
  done
  # The simulated device at 2 ms steps, 256 streams, every one JSON-schema constrained: the host cost of masks.
  run structured-sim-256 "$PY" scripts/compare_peers.py --model sim --workload structured --num-requests 256 \
    --sim-step-us 2000 --json-share 1 --output-len 64 --peers pipeline-async,pipeline-sync \
    --json "$OUT/structured-sim-256.json"
fi
