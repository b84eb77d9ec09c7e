"""Pick the training recipe from a learning-rate pilot's ledger (a study of GRPO entries named lr{LR}_kl{KL}_mb{MB}).

    python scripts/pilot_recipe.py runs/countdown-study/pilot-strong/study.jsonl   # prints: lr=3e-5 kl_coef=0 ...

The rule: among the entries whose held-out mean@k at the pilot's last budget rose by at least --min-gain over the
start policy with greedy accuracy not lower, the one with the largest rise; when none qualifies, the largest rise
anyway (stderr says so). Prints the recipe as key=value overrides on stdout and the reasoning as JSON on stderr.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

NAME = re.compile(r"^lr(?P<lr>[^_]+)_kl(?P<kl>[^_]+)_mb(?P<mb>\d+)$")


def choose(rows: list[dict], min_gain: float = 0.03) -> dict:
    """{"entry", "overrides", "gain": (mean@k, greedy), "qualified": [entries]} from the ledger rows."""
    start = next(r for r in rows if r["entry"] == "start")
    last = max(r["budget"] for r in rows)
    final = [r for r in rows if r["budget"] == last and NAME.match(r["entry"])]
    if not final:
        raise ValueError(f"no pilot entry (lr..._kl..._mb...) at the last budget {last}")
    gain = lambda r: (r["mean@k"] - start["mean@k"], r["greedy"] - start["greedy"])  # noqa: E731
    ok = [r for r in final if gain(r)[0] >= min_gain and gain(r)[1] >= 0]
    best = max(ok or final, key=lambda r: gain(r)[0])
    m = NAME.match(best["entry"])
    return {"entry": best["entry"], "overrides": f"lr={m['lr']} kl_coef={m['kl']} mini_batch_size={m['mb']}",
            "gain": gain(best), "qualified": [r["entry"] for r in ok]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ledger", help="the pilot's study.jsonl")
    ap.add_argument("--min-gain", type=float, default=0.03)
    args = ap.parse_args(argv)
    lines = Path(args.ledger).read_text().splitlines()
    choice = choose([json.loads(line) for line in lines[1:]], args.min_gain)
    if not choice["qualified"]:
        print(f"no entry rose by {args.min_gain} with greedy not lower: taking the largest rise", file=sys.stderr)
    print(json.dumps({k: v for k, v in choice.items() if k != "overrides"}), file=sys.stderr)
    print(choice["overrides"])


if __name__ == "__main__":
    main()
