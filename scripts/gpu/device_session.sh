#!/bin/bash
# The device-tool plan for the GPU figures of issues 10, 11 and 13, one call per argument, on ONE 2-GPU machine kept
# warm between calls (it goes back after 30 s idle):   bash scripts/gpu/device_session.sh N
#   calls 0-4 carry .gpu-stack/cN (the GPU stack of ../shared/tools/gpu-stack, re-split into 5 parts of 52 MB so
#   that .gpu-data, 200 Geometry3K rows with their diagrams, fits beside part 0; re-split the built chunks with
#   cat .gpu-stack/c?/stack.part.? > /tmp/s.xz && (cd /tmp && split -n 5 -d -a 1 s.xz stack.part.) &&
#   for k in 0 1 2 3 4; do rm .gpu-stack/c$k/*; mv /tmp/stack.part.$k .gpu-stack/c$k/; done); every call carries
#   .gpu-stack/extra (qwen-vl-utils, unpacked) and .carry (the TinyZero test split, the study's held-out prompts).
#   Results: $OUT/callN.tgz (result JSON, log tails, run records, the study's ledger and report so far).
# What ran on 2 x H100 on 2026-11-27 (docs/bench/2026-11-27-2xH100, docs/study/countdown-13m), one call each:
#   0 = the models; in the background (setsid, card 1) the 13 M countdown policy, then the study on it (issue 13);
#       on card 0 the update profile (issue 11)       1 = the decode bounds, the text shape on the embedded backend
#   2 = the VL shape on the embedded backend          3 = part 3 only
#   4 = unpack; the text shape on verl, 1 GPU (with bapo_vl.backends.verl_loss's chunked log-probs)
#   5 = 8 minutes in all: card 1, the same with verl's own per-row log-probs (the A/B); card 0, the VL engine
#       checks, a VL step with the vLLM engine, the text engine checks (cut off by the 8 minutes)
#   6 = the text engine checks again
# Cases e and 7-10 (git log -p) were the next plan, one call each; the queued plan below replaced them (2 x H200, 2026-11-27,
#   docs/bench/2026-11-27-2xH200-queued: q0, p1-p3, q4, w 6, w 7 ran everything of scripts/gpu/queues.sh's queues 0
#   and 1 in 27.3 minutes of device time, except the VL shape on verl with 1 GPU).
# Session 8: QUEUES="vl20 vl1" on 2 x H200 (q0, p1-p3, q4, w 6: 19.2 minutes), then QUEUES=score on one H200
#   (the same calls, 3 minutes): docs/results.md, section "Session 8".
# docs/bench/2026-11-27-2xH200 came from an earlier version of this plan (git log -p this file).
R=$PWD; J=/tmp/bench; B=$R/scripts/gpu/bench_backends.py; G=$R/scripts/bench_gpu.py
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p $J/logs /tmp/parts
part() { cp .gpu-stack/c$1/* /tmp/parts/; }
plain() { . scripts/gpu/env.sh; export PYTHONPATH=/tmp/shim; cd /tmp; }   # bapo_vl laid out as installed; no stack
stack() { . scripts/gpu/env.sh; cd /tmp; }  # from /tmp: the repo's own bapo_vl folder must not shadow the shim
save() {  # results + log tails + run records + the study so far back
  mkdir -p /tmp/back/db /tmp/back/study; for f in $J/logs/*.log /tmp/study13.log /tmp/q*.log; do [ -f $f ] && tail -c 60000 $f > /tmp/back/$(basename $f) && grep -a '^{' $f > /tmp/back/$(basename $f .log).jsonl; done  # a log's JSON lines (figures) whole
  for f in $(find /tmp/runs -name run.db); do n=$(dirname ${f#/tmp/runs/} | tr / -); python3 -c "import sqlite3,sys;s=sqlite3.connect(sys.argv[1]);d=sqlite3.connect(sys.argv[2]);s.backup(d)" $f /tmp/back/db/$n.db; done
  cp /tmp/policies/countdown-13m/*.json /tmp/policies/countdown-13m/TRAINING.md /tmp/back/study/ 2>/dev/null
  for d in /tmp/st13*; do [ -f $d/study.jsonl ] && cp $d/study.jsonl /tmp/back/study/$(basename $d).jsonl; done
  cp -r /tmp/out13 /tmp/back/study/ 2>/dev/null; tar czf /tmp/back/study/logs.tgz -C /tmp/st13 logs 2>/dev/null
  cp $J/*.json /tmp/back/ 2>/dev/null; tar czf $OUT/call$1.tgz -C /tmp/back .; ls -la $OUT; pgrep -fa "bapo_vl.study|train_default" | head -3; nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv; }
# each step under the call's deadline (END, seconds since the epoch; default: 9 minutes from the call's start)
END=${END:-$(( $(date +%s) + 540 ))}
T() { local name=$1 rc; shift; echo "== $(date +%T) start $name"; timeout $(( END - $(date +%s) )) "$@" > $J/logs/$name.log 2>&1; rc=$?
      echo "== $(date +%T) end $name rc=$rc"; tail -3 $J/logs/$name.log; }
case $1 in
0) part 0; cp -r .gpu-data/geometry3k /tmp/g3k; plain; nvidia-smi -L; python3 -c "import torch,transformers;print(torch.__version__,transformers.__version__)"
   rm -rf /tmp/r13 /tmp/shim13 && mkdir /tmp/r13 && tar -C $R --exclude=./.gpu-stack/c0 -c . | tar -C /tmp/r13 -x && cp -r /tmp/shim /tmp/shim13
   CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/shim13 setsid nohup bash /tmp/r13/scripts/gpu/study_session.sh 13m-all /tmp/r13 > /tmp/study13.log 2>&1 < /dev/null &
   export CUDA_VISIBLE_DEVICES=0
   T models python3 $B models /tmp/models
   T update python3 $G update --model /tmp/models/text --profile --out $J/update.json
   save 0;;
1) part 1; plain; export CUDA_VISIBLE_DEVICES=0
   T bound-text python3 $B bound --shape text --model /tmp/models/text --out $J/bound-text.json
   T bound-vl python3 $B bound --shape vl --model /tmp/models/vl --out $J/bound-vl.json
   T text-embedded python3 $B train --shape text --backend embedded --model /tmp/models/text --steps 2 --cuda 0 --run-dir /tmp/runs --out $J/text-embedded.json
   save 1;;
2) part 2; plain
   T vl-embedded python3 $B train --shape vl --backend embedded --model /tmp/models/vl --source /tmp/g3k --steps 2 --set micro_batch_size=2 --cuda 0 --run-dir /tmp/runs --out $J/vl-embedded.json
   save 2;;
3) part 3; ls -la /tmp/parts; save 3;;
4) part 4; mkdir -p /tmp/site && cat /tmp/parts/stack.part.* | xz -T16 -dc | tar -x -C /tmp/site && echo unpacked; stack
   T text-verl1 python3 $B train --shape text --backend verl --gpus 1 --cuda 0 --model /tmp/models/text --steps 2 --run-dir /tmp/runs/fix --timeout 500 --out $J/text-verl1.json
   save 4;;
5) stack; END=$(( $(date +%s) + 480 ))
   ( export CUDA_VISIBLE_DEVICES=1 BAPO_VERL_ROW_LOOP_LOGPROBS=1   # A/B: verl's own per-row log-probs
     T text-verl1-rowloop python3 $B train --shape text --backend verl --gpus 1 --cuda 1 --model /tmp/models/text --steps 2 --run-dir /tmp/runs/rowloop --timeout 460 --out $J/text-verl1-rowloop.json ) &
   ( export CUDA_VISIBLE_DEVICES=0
     T engine-checks-vl python3 $R/scripts/gpu/engine_checks.py --preset geometry3k model=/tmp/models/vl "task_options={source: /tmp/g3k}" max_pixels=200704 micro_batch_size=2
     T vl-embedded-vllm python3 $B train --shape vl --backend embedded --model /tmp/models/vl --source /tmp/g3k --steps 2 --cuda 0 --set micro_batch_size=2 rollout_engine=vllm --run-dir /tmp/runs --timeout 300 --out $J/vl-embedded-vllm.json
     T engine-checks python3 $R/scripts/gpu/engine_checks.py ) &
   wait; save 5;;
6) stack; CUDA_VISIBLE_DEVICES=0 T engine-checks python3 $R/scripts/gpu/engine_checks.py; save 6;;
s) save s;;  # the study so far, nothing else
# The queued plan (scripts/gpu/queues.sh: one background queue per card, so no card waits on these calls):
#   q0 = part 0, the models, start both queues (their plain jobs run at once); p1-p3 = parts 1-3;
#   q4 = part 4, unpack (the queues' stack jobs start), then wait; w N = wait. Each wait ends at END (or when the
#   queues are done) and brings back what has finished, every minute too (a call cut off still returns its last).
q0) part 0; cp -r .gpu-data/geometry3k /tmp/g3k; plain; nvidia-smi -L; python3 -c "import torch,transformers;print(torch.__version__,transformers.__version__)"
   T models python3 $B models /tmp/models
   rm -rf /tmp/shimq /tmp/rq && cp -r /tmp/shim /tmp/shimq && mkdir /tmp/rq && tar -C $R --exclude='./.gpu-stack/c?' -c . | tar -C /tmp/rq -x
   for c in ${QUEUES:-0 1}; do setsid nohup bash /tmp/rq/scripts/gpu/queues.sh $c /tmp/rq > /tmp/q$c.log 2>&1 < /dev/null & done
   sleep 5; cat /tmp/q*.log; save q0;;
p1|p2|p3) part ${1#p}; ls -la /tmp/parts; cat /tmp/q*.log;;
q4|w) if [ $1 = q4 ]; then part 4; mkdir -p /tmp/site && cat /tmp/parts/stack.part.* | xz -T16 -dc | tar -x -C /tmp/site && touch /tmp/site/.unpacked && echo unpacked; fi
   n=0; until [ -f $J/done ] || [ $(date +%s) -ge $END ]; do sleep 5; n=$((n + 1)); [ $((n % 12)) = 0 ] && save $1$2 > /dev/null; done
   cat /tmp/q*.log; save $1$2;;
esac
