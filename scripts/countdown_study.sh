#!/usr/bin/env bash
# The countdown study of docs/study/README.md, end to end, on the GPUs this machine has:
#   1. the data: report set (768 TinyZero test rows), dev set (the other 256), training rows without either;
#   2. the start policies: the 13 M countdown SFT (8,000 steps) and its step-1,000 snapshot (the weak one);
#   3. the learning-rate pilot on the dev set, for each start policy: GRPO at lr {1e-5, 3e-5, 1e-4} x KL {0, 1e-3}
#      x {1, 4} optimizer steps per batch of 64 prompts x 8, 30 steps;
#   4. the recipe, chosen from the strong policy's pilot by scripts/pilot_recipe.py;
#   5. the study on the report set for each start policy: grpo, grpo_v5, dapo, bapo, bapo_no_x2, bapo_no_x3 x 5 seeds
#      at 20,480 rollouts (DAPO on to twice that), six log-spaced checkpoints at k = 8, k = 32 and greedy at the end.
#   6. with FOLLOW_UP=1, BAPO with more updates per rollout or fewer re-evaluations, and grpo_replay, at 40,960.
# Every step skips what is done: run again after an interruption, or with the ledgers copied into WORK to write the
# reports without training.
#
#   bash scripts/countdown_study.sh DATA WORK [JOBS]
#     DATA  a folder with tinyzero_test_1024_base.jsonl and countdown_3to4_raw_rows_0-11023.jsonl
#     WORK  data, policies, runs and ledgers (e.g. runs/countdown-study); reports go to docs/study/ (DOCS=...)
#     JOBS  runs at once (default 30; they take turns on the visible GPUs)
set -euo pipefail
DATA=$1; WORK=$2; JOBS=${3:-30}; DOCS=${DOCS:-docs/study}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
D=$WORK/data; P=$WORK/policies/countdown-13m; WEAK=$P/step_1000
COMMON=(device=cuda batch_size=64 group_size=8 generate_batch_size=512 score_batch_size=512 micro_batch_size=256
        "task_options={template: compact, source: $D/train.jsonl}")

[ -f $D/train.jsonl ] || python3 $ROOT/scripts/countdown_splits.py --test $DATA/tinyzero_test_1024_base.jsonl \
  --train $DATA/countdown_3to4_raw_rows_0-11023.jsonl --report 768 --out $D
[ -f $P/training.json ] || python3 $ROOT/scripts/train_default_policy.py --size countdown-13m --out $P \
  --save-at 1000,1250,1500 --eval-every 500 --exclude-file $DATA/tinyzero_test_1024_base.jsonl --eval-data $D/dev.jsonl

PILOT=(); NAMES=()
for lr in 1e-5 3e-5 1e-4; do for kl in 0 1e-3; do for mb in 64 16; do
  NAMES+=(lr${lr}_kl${kl}_mb${mb}); PILOT+=(--entry "lr${lr}_kl${kl}_mb${mb}=algo=grpo lr=$lr kl_coef=$kl mini_batch_size=$mb")
done; done; done
pilot() {  # pilot NAME MODEL REPORT_FOLDER
  python3 -m bapo_vl.study "${PILOT[@]}" --algos "$(IFS=,; echo "${NAMES[*]}")" --seeds 0 --budget 15360 \
    --checkpoints 3 --spacing log --k 8 --split test --source $D/dev.jsonl --runs $WORK/$1 --jobs $JOBS \
    --out $3 "${COMMON[@]}" model=$2
}
pilot pilot-strong $P $DOCS/countdown-13m/pilot
pilot pilot-weak $WEAK $DOCS/countdown-13m-step1000/pilot

read -r -a RECIPE <<< "$(python3 $ROOT/scripts/pilot_recipe.py $WORK/pilot-strong/study.jsonl)"
study() {  # study NAME MODEL REPORT_FOLDER
  python3 -m bapo_vl.study --algos grpo,grpo_v5,dapo,bapo,bapo_no_x2,bapo_no_x3 --seeds 0,1,2,3,4 --budget 20480 \
    --checkpoints 6 --spacing log --k 8 --final-k 32 --hard-k 64 --extend dapo=2 --split test \
    --source $D/report.jsonl --runs $WORK/$1 --jobs $JOBS --out $3 "${COMMON[@]}" model=$2 "${RECIPE[@]}"
}
study study-strong $P $DOCS/countdown-13m/study
study study-weak $WEAK $DOCS/countdown-13m-step1000/study
[ "${FOLLOW_UP:-0}" = 1 ] || exit 0

# FOLLOW_UP=1: where BAPO loses on the weak policy (updates per rollout), the changes that may close it, and the
# replay-buffer peer, at twice the budget (GRPO had not flattened at 20,480)
python3 -m bapo_vl.study --algos grpo,bapo,bapo_mb8,bapo_reeval32,grpo_replay --seeds 0,1,2,3,4 --budget 40960 \
  --entry "bapo_mb8=algo=bapo mini_batch_size=8" --entry "bapo_reeval32=algo=bapo reeval_max=32" \
  --checkpoints 6 --spacing log --k 8 --final-k 32 --hard-k 64 --split test --source $D/report.jsonl \
  --runs $WORK/follow-up-weak --jobs $JOBS --out $DOCS/countdown-13m-step1000/follow-up "${COMMON[@]}" model=$WEAK \
  "${RECIPE[@]}"
