#!/usr/bin/env bash
# What a data worker of scripts/train_vl_policy.py spends per fresh geodraw problem (one CPU thread): drawing it, and
# encoding it with PromptBytes (patches cut from the image's bytes) against the processor's image pipeline, which
# made the same rows before (baseline); printed as JSON with the speed-up of the encoding and of draw + encode.
#
#   benchmarks/sft_data.sh          # N=512 problems at IMAGE_SIZE=224 (the build's), SIZE=geodraw-30m
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || true)
PYTHONPATH="$root" python3 - "$root" "${N:-512}" "${IMAGE_SIZE:-224}" "${SIZE:-geodraw-30m}" "$commit" <<'PY'
import datetime, importlib.util, json, platform, sys, time
import torch

root, n, side, size, commit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] or None
torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("train_vl_policy", f"{root}/scripts/train_vl_policy.py")
T = importlib.util.module_from_spec(spec); spec.loader.exec_module(T)
args = type("A", (), dict(T.SIZES[size], image_size=side, seed=0))
model, processor = T.build(args)
positions = T.PromptPositions(model.config)
t0 = time.perf_counter()
problems = T.get_task().load(split="train", n=n, seed=7, image_size=side)
draw = (time.perf_counter() - t0) / n

def processor_rows():
    codec = None
    for p in problems:
        row = T.encode_row(processor, p, "read", positions, True)
        codec = codec or T.PixelCodec(processor, row["pixel_values"].shape[1])
        codec.to_bytes(row["pixel_values"])

def prompt_bytes_rows():
    fast = T.PromptBytes(processor)
    for p in problems:
        T.encode_row(processor, p, "read", positions, True, fast)

timed = {}
for name, f in (("processor", processor_rows), ("prompt_bytes", prompt_bytes_rows)) * 2:  # the second round counts
    t0 = time.perf_counter(); f(); timed[name] = (time.perf_counter() - t0) / n
print(json.dumps(dict(kind="summary", row="geodraw SFT data, per problem",
                      cpu=platform.processor() or platform.machine(), date=datetime.date.today().isoformat(),
                      commit=commit, problems=n, image_size=side,
                      draw_ms=1e3 * draw, encode_ms=1e3 * timed["prompt_bytes"],
                      baseline=dict(encode_ms=1e3 * timed["processor"]),
                      encode_x_baseline=timed["processor"] / timed["prompt_bytes"],
                      draw_and_encode_x_baseline=(draw + timed["processor"]) / (draw + timed["prompt_bytes"])),
                 indent=1))
PY
