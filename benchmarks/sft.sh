#!/usr/bin/env bash
# The geodraw start policy's SFT step (scripts/train_vl_policy.py, the recipe of scripts/build_geodraw_policy.sh's
# first stage) eager and with --compile, one after the other on one GPU, printed as JSON with the speed-up.
#
#   benchmarks/sft.sh            # baseline: eager; row: the repeated blocks under torch.compile
#
# The step time is the median of the logged steps' mean after the first log line (warm-up and compilation); the
# data wait beside it says whether the data workers bound the step. Optional environment: BENCH_DIR (result files,
# default ./bench-sft), STEPS (default 300), LOG_EVERY (default 25), SIZE (default geodraw-30m), DATA_WORKERS
# (default 14), CARD (CUDA_VISIBLE_DEVICES, default 0), EXTRA (more train_vl_policy.py flags for both runs).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
results=$(realpath -m "${BENCH_DIR:-bench-sft}")
mkdir -p "$results"
sft() {  # sft NAME FLAGS...: one run, its card in $results/NAME/training.json, its log beside it
  local name=$1; shift
  CUDA_VISIBLE_DEVICES=${CARD:-0} PYTHONPATH="$root" python3 "$root/scripts/train_vl_policy.py" \
    --size "${SIZE:-geodraw-30m}" --steps "${STEPS:-300}" --log-every "${LOG_EVERY:-25}" --eval-problems 8 \
    --data-workers "${DATA_WORKERS:-14}" --cpu-threads 1 --no-deterministic --out "$results/$name" ${EXTRA:-} "$@" \
    > "$results/$name.log" 2>&1 || { echo "$name: see $results/$name.log" >&2; return 1; }
}
sft eager
sft compiled --compile
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || true)
python3 - "$results" "$commit" <<'PY'
import datetime, json, statistics, sys
from pathlib import Path

results, commit = Path(sys.argv[1]), sys.argv[2] or None

def row(name):
    card = json.loads((results / name / "training.json").read_text())
    timed = [d for d in card["loss_log"][1:] if "step_seconds" in d]  # after the first log line: warm-up, compile
    return dict(row=f"geodraw SFT step ({name})", card=card["device"], size=card["size"], batch=card["batch"],
                steps=card["steps"], timed_log_lines=len(timed),
                step_seconds=statistics.median(d["step_seconds"] for d in timed) if timed else None,
                data_wait_seconds=statistics.median(d["data_wait_seconds"] for d in timed) if timed else None)

base, out = row("eager"), row("compiled")
same = base["card"] == out["card"] and base["step_seconds"] and out["step_seconds"]
print(json.dumps(dict(kind="summary", date=datetime.date.today().isoformat(), commit=commit, **out, baseline=base,
                      speed_x_baseline=base["step_seconds"] / out["step_seconds"] if same else None), indent=1))
PY
