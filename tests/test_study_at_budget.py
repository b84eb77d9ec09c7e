"""scripts/study_at_budget.py reads a study's ledger at one checkpoint budget, for a grid whose runs did not all
reach the final one. Checked against the study's own report on a real small study (tiny preset, CPU)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_vl.study import main as study

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "study_at_budget.py"
SMALL = ["batch_size=4", "group_size=4", "task_options={template: compact, limit: 64}"]


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=300)


def test_at_the_final_budget_it_gives_the_reports_intervals_and_reads_a_grid_cut_short(tmp_path):
    # Could fail if the script paired other prompts or seeds than the study (its gain over the start and its
    # difference from the baseline would differ from the report's), if it compared a checkpoint's k = 4 samples
    # with the start's final k = 8 evaluation, or if a run missing at a budget broke the entries that have it.
    runs, out = tmp_path / "runs", tmp_path / "out"
    common = ["--seeds", "0,1", "--budget", "40", "--checkpoints", "2", "--k", "4", "--final-k", "8",
                     "--limit", "8", "--runs", str(runs), "--out", str(out), *SMALL]
    assert study(["--algos", "grpo,bapo", *common]) == 0
    stats = json.loads((out / "results.json").read_text())["statistics"]

    done = run(runs / "study.jsonl", 40, "--baseline", "grpo", "--json", tmp_path / "at40.json")
    assert done.returncode == 0, done.stderr
    mine = json.loads((tmp_path / "at40.json").read_text())
    assert mine["k"] == 8 and "bapo (seeds 0, 1):" in done.stdout
    for entry in ("grpo", "bapo"):
        for metric, name in (("mean@k", "mean@8"), ("greedy", "greedy")):
            theirs = stats["gain"][entry][metric]
            ours = mine["entries"][entry][f"{name} vs start"]
            assert ours["diff"] == pytest.approx(theirs["diff"]) and ours["low"] == pytest.approx(theirs["low"])
    theirs = stats["versus"]["bapo"]["mean@k"]
    assert mine["entries"]["bapo"]["mean@8 vs grpo"]["diff"] == pytest.approx(theirs["diff"])

    # a grid cut short: grpo seed 1 has no row at 40 rollouts
    lines = (runs / "study.jsonl").read_text().splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(x for x in lines if not (json.loads(x).get("entry") == "grpo"
                                                       and json.loads(x).get("seed") == 1
                                                       and json.loads(x).get("budget") == 40)) + "\n")
    done = run(cut, 40, "--json", tmp_path / "cut.json")
    assert done.returncode == 0, done.stderr
    cut_result = json.loads((tmp_path / "cut.json").read_text())["entries"]
    assert cut_result["grpo"]["seeds"] == [0] and cut_result["bapo"]["seeds"] == [0, 1]
    assert cut_result["bapo"]["mean@8 vs grpo"]["n_seeds"] == 1  # against each other on the seeds both have
    at20 = run(cut, 20)
    assert at20.returncode == 0 and "mean@4" in at20.stdout  # a checkpoint: k = 4 against the start's k = 4

    for bad, says in ((tmp_path / "none.jsonl", "FileNotFoundError"), (runs / "study.jsonl", "no run has")):
        failed = run(bad, 7 if bad.exists() else 40)
        assert failed.returncode == 2 and says in failed.stderr and str(bad) in failed.stderr
        assert len(failed.stderr.strip().splitlines()) == 1
