#!/bin/bash
# The device-tool plan that produced docs/bench/2026-11-27-2xH200 (issues 10, 11), one call per argument, on ONE
# 2-GPU machine kept warm between calls (it goes back after 30 s idle):   bash scripts/gpu/device_session.sh N
#   calls 0-4 carry .gpu-stack/cN (the GPU stack of ../shared/tools/gpu-stack, re-split into 5 parts of 52 MB so
#   that .gpu-data, 200 Geometry3K rows with their diagrams, fits beside part 0; re-split the built chunks with
#   cat .gpu-stack/c?/stack.part.? > /tmp/s.xz && (cd /tmp && split -n 5 -d -a 1 s.xz stack.part.) &&
#   for k in 0 1 2 3 4; do rm .gpu-stack/c$k/*; mv /tmp/stack.part.$k .gpu-stack/c$k/; done); calls 4-8 carry
#   .gpu-stack/extra (qwen-vl-utils, unpacked).
#   Results: $OUT/callN.tgz (result JSON, log tails, run records). bench_backends removes each run's weights after
#   reading its figures (a 2 B model's checkpoints filled the disk once). 0 = models, bounds and the embedded
#   rows (both cards); 4 = unpack + text on 2 GPUs; 5 = text on 1 GPU beside the vLLM engine checks and bench on the
#   other card; 6 = the VL shape on 1 GPU beside the VL vLLM
#   engine's checks and step on the other card; 7 = the VL shape on 2 GPUs; 8 = the text
#   shape on 1 GPU with verl's own per-row log-probs (the A/B of bapo_vl.backends.verl_loss.logprobs_by_chunks). (In the session itself call 0's embedded rows ran in call 1, and
#   call 5 ran VL on 1 GPU, the machine being lost before 6.)
R=$PWD; J=/tmp/bench; B=$R/scripts/gpu/bench_backends.py; G=$R/scripts/bench_gpu.py
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p $J/logs /tmp/parts
part() { cp .gpu-stack/c$1/* /tmp/parts/; }
plain() { . scripts/gpu/env.sh; export PYTHONPATH=/tmp/shim; cd /tmp; }   # bapo_vl laid out as installed; no stack
stack() { . scripts/gpu/env.sh; cd /tmp; }  # from /tmp: the repo's own bapo_vl folder must not shadow the shim
save() {  # results + log tails + run records back
  mkdir -p /tmp/back/db; for f in $J/logs/*.log; do tail -c 60000 $f > /tmp/back/$(basename $f); done
  for f in $(find /tmp/runs -name run.db); do n=$(dirname ${f#/tmp/runs/} | tr / -); python3 -c "import sqlite3,sys;s=sqlite3.connect(sys.argv[1]);d=sqlite3.connect(sys.argv[2]);s.backup(d)" $f /tmp/back/db/$n.db; done
  cp $J/*.json /tmp/back/ 2>/dev/null; tar czf $OUT/call$1.tgz -C /tmp/back .; ls -la $OUT; }
T() { local name=$1; shift; echo "== $(date +%T) start $name"; "$@" > $J/logs/$name.log 2>&1; echo "== $(date +%T) end $name rc=$?"; tail -3 $J/logs/$name.log; }
case $1 in
0) part 0; cp -r .gpu-data/geometry3k /tmp/g3k; plain; nvidia-smi -L; python3 -c "import torch,transformers;print(torch.__version__,transformers.__version__)"
   T models python3 $B models /tmp/models
   T bound-text python3 $B bound --shape text --model /tmp/models/text --out $J/bound-text.json
   T bound-vl python3 $B bound --shape vl --model /tmp/models/vl --out $J/bound-vl.json
   ( T text-embedded python3 $B train --shape text --backend embedded --model /tmp/models/text --steps 2 --cuda 0 --run-dir /tmp/runs --out $J/text-embedded.json
     CUDA_VISIBLE_DEVICES=0 T engine-text-tf python3 $G engine --engine transformers --shape text --model /tmp/models/text --prompts 64 --out $J/engine-text-transformers.json ) &
   ( T vl-embedded python3 $B train --shape vl --backend embedded --model /tmp/models/vl --source /tmp/g3k --steps 2 --set micro_batch_size=2 --cuda 1 --run-dir /tmp/runs --out $J/vl-embedded.json
     CUDA_VISIBLE_DEVICES=1 T update python3 $G update --model /tmp/models/text --profile --out $J/update.json
     CUDA_VISIBLE_DEVICES=1 T engine-text-tf256 python3 $G engine --engine transformers --shape text --model /tmp/models/text --prompts 256 --no-probe-cb --out $J/engine-text-transformers256.json ) &
   wait; save 0;;
1|2|3) part $1; ls -la /tmp/parts;;
4) part 4; mkdir -p /tmp/site && cat /tmp/parts/stack.part.* | xz -T32 -dc | tar -x -C /tmp/site && echo unpacked; stack
   T text-verl2 python3 $B train --shape text --backend verl --gpus 2 --model /tmp/models/text --steps 2 --run-dir /tmp/runs --timeout 520 --out $J/text-verl2.json
   save 4;;
5) stack
   ( T text-verl1 python3 $B train --shape text --backend verl --gpus 1 --cuda 0 --model /tmp/models/text --steps 2 --run-dir /tmp/runs --timeout 520 --out $J/text-verl1.json ) &
   ( export CUDA_VISIBLE_DEVICES=1
     T engine-checks python3 $R/scripts/gpu/engine_checks.py
     T engine-text-vllm python3 $G engine --engine vllm --shape text --model /tmp/models/text --prompts 64,256 --out $J/engine-text-vllm.json
     T engine-text-vllm512 python3 $G engine --engine vllm --shape text --model /tmp/models/text --prompts 256 --set "vllm_options={max_num_seqs: 512}" --out $J/engine-text-vllm512.json
     T text-embedded-vllm python3 $B train --shape text --backend embedded --model /tmp/models/text --steps 2 --cuda 1 --set rollout_engine=vllm --run-dir /tmp/runs --out $J/text-embedded-vllm.json ) &
   wait; save 5;;
6) stack
   ( T vl-verl1 python3 $B train --shape vl --backend verl --gpus 1 --cuda 0 --model /tmp/models/vl --source /tmp/g3k --steps 2 --run-dir /tmp/runs --timeout 540 --out $J/vl-verl1.json ) &
   ( export CUDA_VISIBLE_DEVICES=1
     T engine-checks-vl python3 $R/scripts/gpu/engine_checks.py --preset geometry3k model=/tmp/models/vl "task_options={source: /tmp/g3k}" max_pixels=200704 micro_batch_size=2
     T vl-embedded-vllm python3 $B train --shape vl --backend embedded --model /tmp/models/vl --source /tmp/g3k --steps 2 --cuda 1 --set micro_batch_size=2 rollout_engine=vllm --run-dir /tmp/runs --out $J/vl-embedded-vllm.json ) &
   wait; save 6;;
8) stack; export BAPO_VERL_ROW_LOOP_LOGPROBS=1  # A/B: verl's own per-row log-probs (bapo_vl.backends.verl_loss)
   T text-verl1-rowloop python3 $B train --shape text --backend verl --gpus 1 --model /tmp/models/text --steps 2 --run-dir /tmp/runs/rowloop --timeout 540 --out $J/text-verl1-rowloop.json; save 8;;
7) stack; T vl-verl2 python3 $B train --shape vl --backend verl --gpus 2 --model /tmp/models/vl --source /tmp/g3k --steps 2 --run-dir /tmp/runs --timeout 540 --out $J/vl-verl2.json; save 7;;
esac
