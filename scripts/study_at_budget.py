"""A study's ledger read at one checkpoint budget: each entry against the start policy and against a baseline entry,
paired by seed and prompt with the study's hierarchical bootstrap (bapo_vl.stats). For a grid whose runs did not
all reach the final budget (the report of `scripts/study.py` needs every run there), or to read an earlier
checkpoint of a finished one.

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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bapo_vl.stats import hierarchical_bootstrap_diff  # noqa: E402


def read_ledger(path: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or "config" not in lines[0]:
        raise ValueError(f"{path}: not a study ledger (its first line holds the study's settings)")
    return lines[0], lines[1:]


def at_budget(rows: list[dict], budget: int, baseline: str | None, resamples: int = 10_000) -> dict:
    runs = {}
    for r in rows:
        if r["budget"] == budget and r["seed"] is not None:
            runs.setdefault(r["entry"], {})[r["seed"]] = r
    if not runs:
        raise ValueError(f"no run has an evaluation at {budget} rollouts (budgets: "
                         f"{sorted({r['budget'] for r in rows if r['seed'] is not None})})")
    sampled = {(r["k"], r["sample_seed"]) for by_seed in runs.values() for r in by_seed.values()}
    if len(sampled) > 1:
        raise ValueError(f"the runs at {budget} were evaluated with different k and sampling seeds: {sorted(sampled)}")
    (k, sample_seed), = sampled
    # the start policy's evaluation with the same k and sampling seed (the study's start, start_final or start_hard)
    start = next((r for r in rows if r["seed"] is None and (r["k"], r["sample_seed"]) == (k, sample_seed)), None)
    if start is None:
        raise ValueError(f"the ledger has no evaluation of the start policy with k {k} and sampling seed {sample_seed}")
    uids = sorted(start["counts"])

    def cells(entry_rows, key):
        return np.array([[r[key][u] / (r["k"] if key == "counts" else 1) for u in uids] for r in entry_rows])

    start_cells = {key: cells([start], key)[0] for key in ("counts", "greedy_counts")}
    out = {"budget": budget, "k": k, "prompts": len(uids), "entries": {}}
    for entry, by_seed in sorted(runs.items()):
        seeds = sorted(by_seed)
        e = {"seeds": seeds}
        for key, name in (("counts", f"mean@{k}"), ("greedy_counts", "greedy")):
            a = cells([by_seed[s] for s in seeds], key)
            e[name] = float(a.mean())
            e[f"{name} vs start"] = hierarchical_bootstrap_diff(a, np.tile(start_cells[key], (len(a), 1)), resamples)
            e[f"{name} vs start by seed"] = [float(x) for x in (a - start_cells[key]).mean(axis=1)]
        if baseline and entry != baseline and baseline in runs:
            both = sorted(set(seeds) & set(runs[baseline]))
            for key, name in (("counts", f"mean@{k}"), ("greedy_counts", "greedy")):
                e[f"{name} vs {baseline}"] = hierarchical_bootstrap_diff(
                    cells([by_seed[s] for s in both], key), cells([runs[baseline][s] for s in both], key), resamples)
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
        _, rows = read_ledger(a.ledger)
        result = at_budget(rows, a.budget, a.baseline)
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
