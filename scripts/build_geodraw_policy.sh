#!/bin/bash
# Rebuild the geodraw-30m start policy (docs/study/geodraw-30m/policy-e/) on one GPU:
#
#     bash scripts/build_geodraw_policy.sh runs/policies/geodraw-30m [--data-workers 14 --no-deterministic]
#
# Two stages of scripts/train_vl_policy.py (the second restarts the learning rate; the numbers are read reliably
# only after it): 2,152 steps of a 2,400-step cosine at lr 1.5e-3 with the glyph loss (FOLDER/stage1, its own card),
# then 2,817 steps of a 4,800-step cosine at lr 1e-3 from it (FOLDER, the policy). Extra flags go to both stages.
# STAGE2_STEPS=N stops the second stage after N of its 4,800 planned steps instead (a weaker start policy, sooner).
# STAGE2_SAVE_AT=N,M also keeps the second stage's policy after steps N and M (FOLDER/step_N, each with its greedy
# accuracy on 128 test problems): the policies STAGE2_STEPS=N and =M would build, from one run, to pick a start of
# the strength wanted.
set -euo pipefail
policy=$(realpath -m "${1:?usage: build_geodraw_policy.sh FOLDER [train_vl_policy.py flags]}"); shift
cd "$(dirname "$0")/.."
PYTHONPATH=. python3 scripts/train_vl_policy.py --size geodraw-30m --steps 2400 --stop-after 2152 \
    --out "$policy/stage1" "$@"
PYTHONPATH=. python3 scripts/train_vl_policy.py --size geodraw-30m --init-from "$policy/stage1" --lr 1e-3 --warmup 50 \
    --steps 4800 --stop-after "${STAGE2_STEPS:-2817}" ${STAGE2_SAVE_AT:+--save-at "$STAGE2_SAVE_AT"} \
    --out "$policy" "$@"
