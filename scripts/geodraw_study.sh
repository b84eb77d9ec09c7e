#!/usr/bin/env bash
# The geodraw RL study of docs/results.md ("Vision-language"), end to end, on the GPUs this machine has:
#   1. the start policy: scripts/build_geodraw_policy.sh (two SFT stages of the 33.5 M Qwen2.5-VL on drawn diagrams),
#      on the first visible card;
#   2. GRPO and BAPO x SEEDS through the embedded backend with its vLLM engine, BUDGET rollouts a run, judged on the
#      1,000 held-out prompts of geodraw's test and val splits (scripts/study.py: paired intervals over seeds and
#      prompts, the hard set, the ledger);
#   3. with VERL=1, the same two algorithms through verl (Ray, FSDP, vLLM) on VERL_GPUS cards, BUDGET / 512 steps of
#      64 prompts x 8, each run's final weights evaluated on the same prompts greedily and with k = 16, paired by
#      prompt against the start policy (`bapo eval --against`).
# Every stage skips what is done: run again after an interruption.
#
#   bash scripts/geodraw_study.sh WORK [JOBS]
#     WORK  the policy, runs and ledgers (e.g. runs/geodraw); the study's report goes to DOCS (default WORK/report)
#     JOBS  embedded runs at once (default 6; they take turns on the visible GPUs; the vLLM engine keeps its memory
#           through the update, so several share a card)
# Environment: SEEDS (default 0,1,2), BUDGET (default 15360), LIMIT (held-out prompts per split, default 500),
# DATA_WORKERS (processes drawing the policy's training problems, default 14), VERL=1 and VERL_GPUS (default 2),
# EMBEDDED=0 (skip stage 2), DEVICE (default cuda), EXTRA (more key=value settings for every run, separated by
# spaces, none inside a value).
set -euo pipefail
WORK=$1; JOBS=${2:-6}; SEEDS=${SEEDS:-0,1,2}; BUDGET=${BUDGET:-15360}; DOCS=${DOCS:-$WORK/report}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
P=$WORK/policies/geodraw-30m-e
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
SETTINGS=(task=geodraw "task_options={template: letter}" max_pixels=50176 max_prompt_length=512 max_response_length=64
          batch_size=64 group_size=8 mini_batch_size=16 lr=3e-5 kl_coef=0)

[ -f "$P/training.json" ] || CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} \
  bash "$ROOT/scripts/build_geodraw_policy.sh" "$P" --eval-every 600 --log-every 100 --cpu-threads 1 \
  --data-workers "${DATA_WORKERS:-14}" --eval-problems 500 --no-deterministic

[ "${EMBEDDED:-1}" = 0 ] || python3 "$ROOT/scripts/study.py" --algos grpo,bapo --seeds "$SEEDS" --budget "$BUDGET" \
  --checkpoints 2 --spacing log \
  --k 8 --final-k 16 --hard-k 32 --split test,val --limit "${LIMIT:-500}" --eval-batch-size 512 --jobs "$JOBS" \
  --runs "$WORK/study" --out "$DOCS" device="${DEVICE:-cuda}" "${SETTINGS[@]}" generate_batch_size=512 \
  score_batch_size=512 micro_batch_size=256 rollout_engine=vllm \
  "vllm_options={gpu_memory_utilization: 0.12, enforce_eager: true, enable_sleep_mode: false}" model="$P" \
  "${EXTRA_ARGS[@]}"
[ "${VERL:-0}" = 1 ] || exit 0

V=$WORK/verl
EVAL=(--task geodraw --template letter --splits test,val --limit "${LIMIT:-500}" --max-new-tokens 64)
mkdir -p "$V"
[ -f "$V/eval-start-k1.json" ] || bapo eval "$P" "${EVAL[@]}" --k 1 --temperature 0 --out "$V/eval-start-k1.json"
[ -f "$V/eval-start-k16.json" ] || bapo eval "$P" "${EVAL[@]}" --k 16 --temperature 1 --out "$V/eval-start-k16.json"
for seed in ${SEEDS//,/ }; do
  for algo in grpo bapo; do
    name=$algo-s$seed
    filter=(); [ $algo = bapo ] && filter=(online_filter=range)  # the verl preset turns BAPO's default filter off
    [ -d "$V/$name/final" ] || bapo train --preset verl_tiny_vl model="$P" "${SETTINGS[@]}" steps=$((BUDGET / 512)) \
      entropy_coef=0 algo=$algo "${filter[@]}" seed="$seed" verl.trainer.n_gpus_per_node="${VERL_GPUS:-2}" \
      verl.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 \
      verl.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64 run_dir="$V" name="$name" "${EXTRA_ARGS[@]}"
    for k in 1 16; do
      t=$([ $k = 1 ] && echo 0 || echo 1)
      [ -f "$V/eval-$name-k$k.json" ] || bapo eval "$V/$name" "${EVAL[@]}" --k $k --temperature $t \
        --against "$V/eval-start-k$k.json" --out "$V/eval-$name-k$k.json"
    done
  done
done
