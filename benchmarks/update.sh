#!/usr/bin/env bash
# The embedded backend's update on one GPU: one row of benchmarks/README.md, printed as JSON with the speed over the
# baseline row measured by the same invocation (each row its own process, one after the other on the same card).
#
#   benchmarks/update.sh MODEL_DIR          # compute copy + torch.compile of the blocks; baseline: compute copy
#   benchmarks/update.sh MODEL_DIR G3K_DIR  # the same on a VL shape (default vl3b), prompts with their diagrams
#
# MODEL_DIR: `python scripts/gpu/bench_backends.py models DIR --shapes text151k` made DIR/text151k (the 0.36 B text
# shape with Qwen's 151,936-word vocabulary, random weights), `--shapes vl3b` DIR/vl3b. Optional environment: BENCH_DIR
# (result files, default ./bench-update), REPEAT (timed updates per row, default 3), SET (more Config fields,
# KEY=VALUE ...), SHAPE (with G3K_DIR, default vl3b), PROMPTS (VL shapes: prompts of the update, default 4).
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,11p' "$0"; exit 2; }
model=$(realpath "$1")
g3k=${2:+$(realpath "$2")}
shape=text
[ -z "$g3k" ] || shape=${SHAPE:-vl3b}
bench=$(realpath "$(dirname "$0")/../scripts/bench_gpu.py")
results=$(realpath -m "${BENCH_DIR:-bench-update}")
mkdir -p "$results"
update() {  # update NAME SETTINGS...: one row, its result in $results/NAME.json, its log beside it
  local name=$1; shift
  python "$bench" update --shape "$shape" ${g3k:+--source "$g3k" --prompts "${PROMPTS:-4}"} --model "$model" \
    --repeat "${REPEAT:-3}" --out "$results/$name.json" --set mixed_precision=compute_copy ${SET:-} "$@" \
    > "$results/$name.log" 2>&1 || { echo "$name: see $results/$name.log" >&2; return 1; }
}
update compute-copy
update compute-copy-compiled compile=true
python "$bench" summary "$results/compute-copy-compiled.json" --baseline "$results/compute-copy.json"
