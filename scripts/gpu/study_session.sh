#!/bin/bash
# The device-tool call behind docs/study/countdown-tiny(-knobs) (issue 13), and the plan for the 13 M start policy.
# One GPU machine, no GPU stack needed (torch + transformers are there); carry .carry (the held-out file:
# cp ../shared/data/countdown/tinyzero_test_1024_base.jsonl .carry/) and .gpu-stack/extra.
#   bash scripts/gpu/study_session.sh tiny     # the bundled policy: 7 algorithms x 3 seeds, then 6 knobs x 1 seed
#   bash scripts/gpu/study_session.sh 13m-policy   # train the 13 M policy (seeded SFT, ~4 min on an H200)
#   bash scripts/gpu/study_session.sh 13m      # then the same grid on it (again until it prints the table)
#   bash scripts/gpu/study_session.sh 13m-all REPO   # both, for a background (setsid) process: the caller's
#        environment (PYTHONPATH, CUDA_VISIBLE_DEVICES) as it is, a copy of the repo in REPO, results in /tmp/out13;
#        the policy is trained only if /tmp/policies/countdown-13m has none; LR=X runs the grid at lr X instead
# The ledger (study.jsonl) and the reports go to $OUT every 15 s and at the end, finished or not: the same command on
# the same warm machine continues a study, and a ledger copied back makes the report and plots here without training.
if [ "$1" = 13m-all ]; then R=$2; OUT=/tmp/out13; mkdir -p $OUT; else . scripts/gpu/env.sh; export PYTHONPATH=/tmp/shim; R=$PWD; fi
export PYTHONUNBUFFERED=1; cd /tmp
nproc; nvidia-smi -L
HELD="--split test --source $R/.carry/tinyzero_test_1024_base.jsonl --k 16 --limit 256"
KNOBS="bapo_v1,bapo_v2,bapo_m1,bapo_gaussian,bapo_age1,bapo_age6"
case $1 in
tiny) RUNS=/tmp/st; S="--budget 15360 --checkpoints 2 $HELD --runs $RUNS device=cuda"
      STUDY="python3 $R/scripts/study.py --seeds 0,1,2 --jobs 14 $S --out $OUT/countdown-tiny; \
             python3 $R/scripts/study.py --algos $KNOBS --seeds 0 --jobs 6 $S --out $OUT/knobs";;
13m-policy) timeout 540 python3 $R/scripts/train_default_policy.py --size countdown-13m --out /tmp/policies/countdown-13m \
          --exclude-file $R/.carry/tinyzero_test_1024_base.jsonl --eval-data $R/.carry/tinyzero_test_1024_base.jsonl \
          --eval-every 1000 2>&1 | tail -30; cp /tmp/policies/countdown-13m/*.json $OUT/ 2>/dev/null; exit;;
13m-all) [ -f /tmp/policies/countdown-13m/model.safetensors ] || python3 $R/scripts/train_default_policy.py \
          --size countdown-13m --out /tmp/policies/countdown-13m --exclude-file $R/.carry/tinyzero_test_1024_base.jsonl \
          --eval-data $R/.carry/tinyzero_test_1024_base.jsonl --eval-every 1000 || exit 1
      # LR=2e-5 (say): the same grid at another learning rate, in its own ledger (at the tiny preset's 2e-4 every
      # method lowered this policy's accuracy: docs/study/README.md)
      python3 -m bapo_vl.study --seeds 0,1,2 --jobs 21 --budget 15360 --checkpoints 2 $HELD --runs /tmp/st13${LR:+-lr$LR} \
          model=/tmp/policies/countdown-13m device=cuda ${LR:+lr=$LR} --out $OUT/countdown-13m${LR:+-lr$LR}
      echo "study rc=$?"; exit;;
13m)  RUNS=/tmp/st13
      S="--budget 15360 --checkpoints 2 $HELD --runs $RUNS model=/tmp/policies/countdown-13m device=cuda"
      STUDY="python3 $R/scripts/study.py --seeds 0,1,2 --jobs 14 $S --out $OUT/countdown-13m";;
*) echo "usage: $0 tiny|13m-policy|13m"; exit 2;;
esac
mkdir -p $RUNS; (while sleep 15; do cp $RUNS/study.jsonl $OUT/ 2>/dev/null; done) >/dev/null 2>&1 & LOOP=$!
timeout 540 sh -c "$STUDY"; echo "study rc=$?"
kill $LOOP; cp $RUNS/study.jsonl $OUT/; tar czf $OUT/logs.tgz -C $RUNS logs
