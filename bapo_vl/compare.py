"""Compare trained policies by their `bapo eval --out` files, with the study's statistics: for runs trained outside
`bapo_vl.study` (through verl, on another machine, by hand), evaluated on the same problems.

    bapo eval runs/start-policy --splits test,val --k 16 --out start.json      # and each run: --out grpo-s0.json ...
    bapo compare start.json --entry grpo=grpo-s0.json,grpo-s1.json,grpo-s2.json \\
        --entry bapo=bapo-s0.json,bapo-s1.json,bapo-s2.json --baseline grpo

An entry is one method, its files one per training seed, listed in seed order: entries are paired by position (the
i-th file of each is seed i) and by problem. Every file must measure the same thing (greedy: `--k 1 --temperature
0`; else mean@k at temperature 1) on the same problems (each set's problem uids). Per problem the accuracy is
correct / k. Printed, as in the study's report (bapo_vl/study.py):

- each entry's mean over seeds and problems, with a 95 % hierarchical bootstrap interval (seeds, then problems
  within each);
- its gain over the start policy's file, paired by problem (the start is one policy, the same row for every seed),
  and each seed's gain with an interval from resampling its problems alone (what a target "in every seed" is read
  on);
- each entry minus the baseline entry, paired by seed and problem, with its two-sided p and Holm's correction over
  the entries compared.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bapo_vl.evaluate import read_against
from bapo_vl.stats import hierarchical_bootstrap_diff, hierarchical_bootstrap_mean, holm

RESAMPLES = 10_000


def measure(result: dict) -> str:
    """What an evaluation measured: greedy (temperature 0) or mean@k."""
    return "greedy" if result.get("temperature") == 0 else f"mean@{result['k']}"


def problems(result: dict) -> list[str]:
    """Every problem of the evaluation, as SET/UID."""
    return [f"{name}/{uid}" for name, s in sorted(result["sets"].items()) for uid in s["problems"]]


def accuracy(result: dict, file: str, keys: list[str]) -> np.ndarray:
    """Per-problem accuracy (correct / k) in the order of `keys`, or one ValueError line naming the first problem
    the file lacks."""
    out = []
    for key in keys:
        name, uid = key.split("/", 1)
        counts = result["sets"].get(name, {}).get("problems", {})
        if uid not in counts:
            raise ValueError(f"{file}: no result for problem {uid} of set {name}, which the start policy's file has: "
                             f"evaluate every policy on the same problems")
        out.append(counts[uid] / result["k"])
    return np.array(out)


def compare(start_file: str, entries: dict[str, list[str]], baseline: str | None = None,
            resamples: int = RESAMPLES) -> dict:
    """The statistics of the module docstring, as one JSON-able object."""
    if not entries:
        raise ValueError("give at least one --entry NAME=FILE[,FILE...]")
    if baseline is not None and baseline not in entries:
        raise ValueError(f"--baseline {baseline}: not an entry (entries: {', '.join(entries)})")
    start = read_against(start_file, label=start_file)
    keys, what = problems(start), measure(start)
    task = start.get("task")
    rows = {}
    for name, files in entries.items():
        if not files:
            raise ValueError(f"--entry {name}: no files")
        cells = []
        for file in files:
            result = read_against(file, label=file)
            if measure(result) != what:
                raise ValueError(f"{file}: it measured {measure(result)}, the start policy's file {what}: compare one "
                                 f"measure at a time")
            if result.get("task") not in (None, task):
                raise ValueError(f"{file}: it evaluated task {result['task']}, the start policy's file {task}")
            cells.append(accuracy(result, file, keys))
        rows[name] = np.stack(cells)
    base = accuracy(start, start_file, keys)
    out = {"measure": what, "task": task, "problems": len(keys), "start": {"file": start_file, "mean": base.mean()},
           "entries": {}, "baseline": baseline, "versus": {}}
    for name, cells in rows.items():
        out["entries"][name] = {
            "files": entries[name], "seeds": len(cells),
            **hierarchical_bootstrap_mean(cells, resamples),
            "gain": hierarchical_bootstrap_diff(cells, np.repeat(base[None], len(cells), axis=0), resamples),
            "gain_by_seed": [hierarchical_bootstrap_diff(c[None], base[None], resamples) for c in cells]}
    if baseline is not None:
        for name in [n for n in rows if n != baseline]:
            if len(rows[name]) != len(rows[baseline]):
                raise ValueError(f"--entry {name}: {len(rows[name])} files, the baseline {baseline} "
                                 f"{len(rows[baseline])}: entries are paired by seed, give one file per seed to each")
            out["versus"][name] = hierarchical_bootstrap_diff(rows[name], rows[baseline], resamples)
        corrected = holm({n: d["p"] for n, d in out["versus"].items()})
        for n, d in out["versus"].items():
            d.update(p_holm=corrected[n]["p_holm"], differs=corrected[n]["reject"])
    return out


def report(result: dict) -> str:
    """The comparison as markdown tables."""
    m = result["measure"]
    lines = [f"{result['problems']:,} problems; {m} per problem; intervals: 95 %, hierarchical bootstrap over seeds "
             "and then problems", "",
             f"| | seeds | {m} [95 % interval] | Δ vs start [95 % interval] | "
             "Δ by seed [95 % interval over its problems] |",
             "| --- " * 5 + "|",
             f"| start policy | – | {result['start']['mean']:.3f} | – | – |"]
    for name, e in result["entries"].items():
        g = e["gain"]
        lines.append(f"| {name} | {e['seeds']} | {e['mean']:.3f} [{e['low']:.3f}, {e['high']:.3f}] | "
                     f"{g['diff']:+.3f} [{g['low']:+.3f}, {g['high']:+.3f}] | "
                     + " / ".join(f"{x['diff']:+.3f} [{x['low']:+.3f}, {x['high']:+.3f}]" for x in e["gain_by_seed"])
                     + " |")
    if result["versus"]:
        b = result["baseline"]
        lines += ["", f"Each entry minus {b}, paired by seed and problem (Holm's correction over the "
                  f"{len(result['versus'])} comparison{'s' if len(result['versus']) > 1 else ''}):", "",
                  f"| | Δ {m} [95 % interval] | p | p (Holm) | differs |", "| --- " * 5 + "|"]
        for name, d in result["versus"].items():
            lines.append(f"| {name} - {b} | {d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] | {d['p']:.4f} | "
                         f"{d['p_holm']:.4f} | {'yes' if d['differs'] else 'no'} |")
    return "\n".join(lines)


def parse_entries(specs: list[str]) -> dict[str, list[str]]:
    entries = {}
    for spec in specs:
        name, sep, files = spec.partition("=")
        if not sep or not name or name in entries:
            raise ValueError(f"--entry {spec}: expected NAME=FILE[,FILE...] with a name of its own")
        entries[name] = [f for f in files.split(",") if f]
    return entries


def cmd_compare(start: str, entry_specs: list[str], baseline: str | None, resamples: int = RESAMPLES,
                as_json: bool = False, out: str | None = None) -> int:
    """`bapo compare`: the comparison printed as tables (or JSON), and written to `out` as JSON."""
    result = compare(start, parse_entries(entry_specs), baseline, resamples)
    text = json.dumps(result, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    print(text if as_json else report(result))
    return 0
