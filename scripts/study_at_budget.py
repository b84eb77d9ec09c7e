"""A study's ledger read at one checkpoint budget: each entry against the start policy and against a baseline entry,
paired by seed and prompt as the study's report pairs them (bapo_vl.study's gain and versus, at that budget). For a
grid whose runs did not all reach the final budget (the report of `scripts/study.py` needs every run there), or to
read an earlier checkpoint of a finished one.

    python scripts/study_at_budget.py RUNS/study.jsonl 15360 [--baseline grpo] [--json OUT.json]

Every entry is compared with the seeds it has at that budget; entries against each other only on the seeds both
have. mean@k is over the k samples of the checkpoint evaluation (the start policy's evaluation with the same k and
sampling seed), greedy over one greedy answer per prompt.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bapo_vl.study import RESAMPLES, accuracy, entry_rows, gain, start_for, versus  # noqa: E402


def read_ledger(path: Path) -> dict:
    """The ledger as the study's analysis takes it: {"settings", "runs": [rows], and each start evaluation by name}."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or "config" not in lines[0]:
        raise ValueError(f"{path}: not a study ledger (its first line holds the study's settings)")
    rows = lines[1:]
    return {"settings": lines[0], "runs": [r for r in rows if r["seed"] is not None],
            **{r["entry"]: r for r in rows if r["seed"] is None}}


def at_budget(result: dict, budget: int, baseline: str | None, resamples: int = RESAMPLES) -> dict:
    """Each entry's evaluations at `budget` against the start's (bapo_vl.study.gain) and the baseline's
    (bapo_vl.study.versus, on the seeds both have)."""
    entries = sorted({r["entry"] for r in result["runs"] if r["budget"] == budget})
    if not entries:
        raise ValueError(f"no run has an evaluation at {budget} rollouts (budgets: "
                         f"{sorted({r['budget'] for r in result['runs']})})")
    start = start_for(result, [r for e in entries for r in entry_rows(result, e, budget)])
    k, uids = start["k"], sorted(start["counts"])
    out = {"budget": budget, "k": k, "prompts": len(uids), "entries": {}}
    for entry in entries:
        rows = entry_rows(result, entry, budget)
        e = {"seeds": [r["seed"] for r in rows]}
        for metric, name in (("mean@k", f"mean@{k}"), ("greedy", "greedy")):
            a = accuracy(rows, uids, metric)
            e[name] = float(a.mean())
            e[f"{name} vs start"] = gain(result, entry, metric, resamples, budget)
            e[f"{name} vs start by seed"] = [float(x) for x in (a - accuracy([start], uids, metric)).mean(axis=1)]
            if baseline and entry != baseline and baseline in entries:
                e[f"{name} vs {baseline}"] = versus(result, entry, baseline, metric, resamples, budget)
        out["entries"][entry] = e
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ledger", type=Path)
    ap.add_argument("budget", type=int)
    ap.add_argument("--baseline", default="grpo")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    try:
        result = at_budget(read_ledger(a.ledger), a.budget, a.baseline)
    except (OSError, ValueError, KeyError) as e:
        print(f"study_at_budget: {a.ledger}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    k = result["k"]
    print(f"{a.ledger} at {a.budget:,} rollouts, {result['prompts']} prompts (95 % intervals, paired)")
    for entry, e in result["entries"].items():
        line = [f"{entry} (seeds {', '.join(map(str, e['seeds']))}):"]
        for name in (f"mean@{k}", "greedy"):
            d = e[f"{name} vs start"]
            by_seed = " / ".join(f"{x:+.3f}" for x in e[f"{name} vs start by seed"])
            line.append(f"{name} {e[name]:.3f}, vs start {d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] "
                        f"(by seed {by_seed})")
            if (b := e.get(f"{name} vs {a.baseline}")) is not None:
                line.append(f"  vs {a.baseline} {b['diff']:+.3f} [{b['low']:+.3f}, {b['high']:+.3f}] p {b['p']:.3f}")
        print("\n  ".join(line))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
