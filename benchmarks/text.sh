#!/usr/bin/env bash
# A training step of the 0.36 B text shape (countdown, 64 prompts x 8 x up to 512 tokens, random weights) on one GPU
# through the embedded backend: one row of benchmarks/README.md, printed as JSON with the ratio against the baseline
# row measured by the same invocation.
#
#   benchmarks/text.sh MODEL_DIR          # vLLM engine, baseline: the transformers engine (model.generate)
#
# MODEL_DIR: `python scripts/gpu/bench_backends.py models DIR --shapes text` made DIR/text. Optional environment:
# BENCH_DIR (result files, default ./bench-text), STEPS (default 5: step 1 is warm-up), TIMEOUT (seconds per run,
# default 1800), CARD (CUDA_VISIBLE_DEVICES of both runs, default 0), SET (more Config fields, KEY=VALUE ...).
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,10p' "$0"; exit 2; }
model=$(realpath "$1")
bench=$(realpath "$(dirname "$0")/../scripts/gpu/bench_backends.py")
results=$(realpath -m "${BENCH_DIR:-bench-text}")
mkdir -p "$results"
train() {  # train NAME SETTINGS...: one run, its result in $results/NAME.json, its log beside it
  local name=$1; shift
  python "$bench" train --shape text --backend embedded --model "$model" --steps "${STEPS:-5}" \
    --run-dir "$results/runs" --timeout "${TIMEOUT:-1800}" --cuda "${CARD:-0}" --out "$results/$name.json" \
    --set ${SET:-} "$@" > "$results/$name.log" 2>&1 || { echo "$name: see $results/$name.log" >&2; return 1; }
}
train embedded-transformers rollout_engine=transformers
train embedded-vllm rollout_engine=vllm
python "$bench" summary "$results/embedded-vllm.json" --baseline "$results/embedded-transformers.json"
