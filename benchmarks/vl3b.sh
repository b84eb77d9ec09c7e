#!/usr/bin/env bash
# Qwen2.5-VL-3B's shape (random weights) at EasyR1's per-GPU setting on Geometry3K: one row of benchmarks/README.md,
# printed as JSON with the ratio against the baseline row measured by the same invocation.
#
#   benchmarks/vl3b.sh embedded MODEL_DIR G3K_DIR        # vLLM engine, baseline: the transformers engine (1 GPU)
#   benchmarks/vl3b.sh verl MODEL_DIR G3K_DIR GPUS        # verl on GPUS cards, baseline: verl on 1 (GPUS=1: no ratio)
#
# MODEL_DIR: `python scripts/gpu/bench_backends.py models DIR --shapes vl3b` made DIR/vl3b. Optional environment:
# BENCH_DIR (result files, default ./bench-vl3b), STEPS (default 3: step 1 is warm-up), TIMEOUT (seconds per run, default
# 7200), CARDS (CUDA_VISIBLE_DEVICES of the run, default the first GPUS cards). verl with GPUS > 1 and CARDS naming
# at least GPUS + 1 cards: the 1-GPU baseline runs on the first card and the row on the next GPUS, at the same time
# (they share the host), instead of one after the other. EMBEDDED_SET: more Config fields for both embedded rows'
# update, e.g. "mixed_precision=compute_copy micro_batch_size=2 compile=true" (a 141 GB card: docs/results.md).
# VERL_SET: more settings for both verl rows, e.g. "verl.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
# verl.actor_rollout_ref.model.use_fused_kernels=false" (EasyR1's micro-batches, full logits).
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,15p' "$0"; exit 2; }
row=$1 model=$(realpath "$2") g3k=$(realpath "$3") gpus=${4:-1}
bench=$(realpath "$(dirname "$0")/../scripts/gpu/bench_backends.py")
results=$(realpath -m "${BENCH_DIR:-bench-vl3b}")
mkdir -p "$results"
cd "$results"  # outside the checkout: Ray's workers import the installed package
train() {  # train NAME ARGS...: one run, its result in $results/NAME.json, its log beside it
  local name=$1; shift
  python "$bench" train --shape vl3b --model "$model" --source "$g3k" --steps "${STEPS:-3}" --run-dir "$results/runs" \
    --timeout "${TIMEOUT:-7200}" ${CARDS:+--cuda "$CARDS"} --out "$results/$name.json" "$@" > "$results/$name.log" 2>&1 \
    || { echo "$name: see $results/$name.log" >&2; return 1; }
}
case $row in
  embedded)  # the vLLM row first: it is the row of interest, and its transformers baseline takes much longer
    train embedded-vllm --backend embedded --set rollout_engine=vllm ${EMBEDDED_SET:-}
    train embedded-transformers --backend embedded --set rollout_engine=transformers ${EMBEDDED_SET:-}
    python "$bench" summary "$results/embedded-vllm.json" --baseline "$results/embedded-transformers.json" ;;
  verl)
    verl_set=(${VERL_SET:+--set $VERL_SET})  # word-split: one --set, each setting its own argument
    IFS=, read -ra cards <<< "${CARDS:-}"
    if [ "$gpus" -gt 1 ] && [ "${#cards[@]}" -gt "$gpus" ]; then
      rest=$(IFS=,; echo "${cards[*]:1:$gpus}")
      train verl1 --backend verl --gpus 1 --cuda "${cards[0]}" "${verl_set[@]}" & baseline=$!
      train "verl$gpus" --backend verl --gpus "$gpus" --cuda "$rest" "${verl_set[@]}" & row=$!
      failed=0; wait $baseline || failed=1; wait $row || failed=1; [ $failed -eq 0 ]
    else
      train verl1 --backend verl --gpus 1 ${CARDS:+--cuda "${CARDS%%,*}"} "${verl_set[@]}"
      [ "$gpus" -eq 1 ] || train "verl$gpus" --backend verl --gpus "$gpus" "${verl_set[@]}"
    fi
    if [ "$gpus" -eq 1 ]; then
      python "$bench" summary "$results/verl1.json"
    else
      python "$bench" summary "$results/verl$gpus.json" --baseline "$results/verl1.json"
    fi ;;
  *) echo "row: embedded or verl, not $row" >&2; exit 2 ;;
esac
