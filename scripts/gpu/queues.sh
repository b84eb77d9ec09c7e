#!/bin/bash
# Issue 10's backend matrix and issue 11's engine figures as one background queue per card of a 2-GPU machine, so
# that no card waits on the device tool's calls (device_session.sh q0 starts both; later calls only wait and save).
# Each queue runs its plain jobs (no stack on the path: the embedded backend as it is today), waits for the unpacked
# stack (/tmp/site/.unpacked, device_session.sh q4), runs its stack jobs and writes /tmp/bench/doneCARD; queue 0 then
# waits for queue 1 and runs the 2-GPU verl rows (queues 0 and 1 ran on 2 x H200 on 2026-11-27: docs/results.md).
# Ran on 2 x H200 in session 8 (QUEUES="vl20 vl1"; docs/results.md): vl20 (card 0) the 2.0 B VL shape on verl, 1 GPU, 8 prompts x 8 for 20
# steps, and its final/ loaded with from_pretrained; vl1 (card 1) the embedded VL row for 4 steps (does step 2's
# gradient norm come out non-finite again? the update now skips such a step and names the tensors), the two VL
# engines' decode benches, model.generate with gqa_decode's attention against transformers' SDPA (text, 64 x 8), the
# update with and without torch.compile (does fusing the element-wise work lift the MFU?), and the VL row with vLLM.
# score (one card): behaviour scoring per score_batch_size, the VL engines with vLLM's caches reset (session 8).
#                           usage: setsid queues.sh QUEUE REPO   (QUEUE: 0, 1, vl20 or vl1; DRY=1: print only)
C=$1; R=$2; J=/tmp/bench; B=$R/scripts/gpu/bench_backends.py; G=$R/scripts/bench_gpu.py
K=${C#vl}; K=${K/20/0}; K=${K/score/0}  # the card: 0, 1, vl20 -> 0, vl1 -> 1, score -> 0
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
       RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=true RAY_DEDUP_LOGS=0
mkdir -p $J/logs && cd /tmp  # from /tmp: a repo's own bapo_vl folder must not shadow the shim
T() { local name=$1 rc; shift; echo "== $(date +%T) start $name"; ${DRY:+echo} "$@" > $J/logs/$name.log 2>&1; rc=$?
      echo "== $(date +%T) end $name rc=$rc"; }
plain() { export PYTHONPATH=/tmp/shimq CUDA_VISIBLE_DEVICES=$K; }
stack() { until [ -f /tmp/site/.unpacked ]; do sleep 2; done; echo "== $(date +%T) stack ready"
          export PYTHONPATH=/tmp/shimq:/tmp/site:$R/.gpu-stack/extra CUDA_VISIBLE_DEVICES=$K; }
VL="--shape vl --model /tmp/models/vl --source /tmp/g3k"; TEXT="--shape text --model /tmp/models/text"
case $C in
0) plain
   T bound-text python3 $B bound --shape text --model /tmp/models/text --out $J/bound-text.json
   T bound-vl python3 $B bound --shape vl --model /tmp/models/vl --out $J/bound-vl.json
   T text-embedded python3 $B train $TEXT --backend embedded --steps 2 --cuda 0 --run-dir /tmp/runs --out $J/text-embedded.json
   stack
   T text-verl1 python3 $B train $TEXT --backend verl --gpus 1 --cuda 0 --steps 2 --run-dir /tmp/runs --timeout 560 --out $J/text-verl1.json
   T engine-text-vllm256 python3 $G engine --engine vllm $TEXT --prompts 256 --out $J/engine-text-vllm256.json
   T engine-text-vllm-graphs1024 python3 $G engine --engine vllm $TEXT --prompts 256 --set "vllm_options={compilation_config: {max_cudagraph_capture_size: 1024}}" --out $J/engine-text-vllm-graphs1024.json
   touch $J/done0; until [ -f $J/done1 ]; do sleep 2; done; unset CUDA_VISIBLE_DEVICES
   T vl-verl2 python3 $B train $VL --backend verl --gpus 2 --steps 2 --run-dir /tmp/runs --timeout 700 --out $J/vl-verl2.json
   T text-verl2 python3 $B train $TEXT --backend verl --gpus 2 --steps 2 --run-dir /tmp/runs --timeout 560 --out $J/text-verl2.json
   touch $J/done;;
1) plain
   T vl-embedded python3 $B train $VL --backend embedded --steps 2 --set micro_batch_size=2 --cuda 1 --run-dir /tmp/runs --out $J/vl-embedded.json
   T engine-text-tf python3 $G engine --engine transformers $TEXT --prompts 64 --no-probe-cb --out $J/engine-text-transformers.json
   T engine-text-tf512 python3 $G engine --engine transformers $TEXT --prompts 64 --no-probe-cb --set generate_batch_size=512 --out $J/engine-text-transformers512.json
   stack
   T engine-checks-vl python3 $R/scripts/gpu/engine_checks.py --preset geometry3k model=/tmp/models/vl "task_options={source: /tmp/g3k}" max_pixels=200704 micro_batch_size=2
   T engine-text-vllm512 python3 $G engine --engine vllm $TEXT --prompts 256 --set "vllm_options={max_num_seqs: 512}" --out $J/engine-text-vllm512.json
   touch $J/done1;;
vl20) stack
   T vl-verl1-20 python3 $B train $VL --backend verl --gpus 1 --cuda 0 --steps 20 --set batch_size=8 mini_batch_size=8 --keep-weights --run-dir /tmp/runs --timeout 1700 --out $J/vl-verl1-20.json
   T vl-verl1-final python3 -c "import sys; from transformers import AutoModelForImageTextToText as M, AutoProcessor as P; m = M.from_pretrained(sys.argv[1]); P.from_pretrained(sys.argv[1]); print(type(m).__name__, sum(p.numel() for p in m.parameters()))" /tmp/runs/bench-vl-verl1/final
   rm -rf /tmp/runs/bench-vl-verl1/final /tmp/runs/bench-vl-verl1/checkpoints
   until [ -f $J/done1 ]; do sleep 2; done; touch $J/done;;
score) plain  # session 8's last minutes, one card: behaviour scoring per score_batch_size; the VL engines, cold caches
   T score-vl python3 $G score $VL --set micro_batch_size=2 --out $J/score-vl.json
   T score-text python3 $G score $TEXT --prompts 64 --set micro_batch_size=16 --out $J/score-text.json
   stack
   T engine-vl-vllm-cold python3 $G engine --engine vllm $VL --prompts 16 --out $J/engine-vl-vllm-cold.json
   touch $J/done;;
vl1) plain
   T engine-text-tf python3 $G engine --engine transformers $TEXT --prompts 64 --no-probe-cb --out $J/engine-text-transformers.json
   T engine-vl-tf python3 $G engine --engine transformers $VL --prompts 16 --no-probe-cb --out $J/engine-vl-transformers.json
   T update python3 $G update --model /tmp/models/text --out $J/update.json
   T update-compiled python3 $G update --model /tmp/models/text --compile --out $J/update-compiled.json
   T vl-embedded4 python3 $B train $VL --backend embedded --steps 4 --set micro_batch_size=2 --cuda 1 --run-dir /tmp/runs --out $J/vl-embedded4.json
   stack
   T engine-vl-vllm python3 $G engine --engine vllm $VL --prompts 16 --out $J/engine-vl-vllm.json
   T vl-embedded-vllm python3 $B train $VL --backend embedded --steps 2 --set micro_batch_size=2 rollout_engine=vllm --cuda 1 --run-dir /tmp/runs --out $J/vl-embedded-vllm.json
   touch $J/done1;;
esac
