"""`bapo compare` (bapo_vl/compare.py): policies compared by their `bapo eval --out` files with the study's statistics.
The files come from real `bapo eval` runs of the bundled countdown-tiny policy on CPU (different sampling seeds stand
in for training seeds), and from edits of them whose answer is known by hand."""
import json

import numpy as np
import pytest

from bapo_vl.cli import main
from bapo_vl.compare import compare, problems
from bapo_vl.stats import hierarchical_bootstrap_diff

EVAL = ["eval", "countdown-tiny", "--task", "countdown", "--template", "compact", "--splits", "cd34,cd4",
        "--limit", "12", "--max-new-tokens", "40", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def evals(tmp_path_factory):
    """Real evaluation files: greedy, and k = 4 samples with three sampling seeds, on 24 problems of two sets."""
    root = tmp_path_factory.mktemp("evals")
    files = {"greedy": root / "greedy.json"}
    assert main([*EVAL, "--k", "1", "--temperature", "0", "--out", str(files["greedy"])]) == 0
    for seed in (0, 1, 2):
        files[seed] = root / f"k4-s{seed}.json"
        assert main([*EVAL, "--k", "4", "--seed", str(seed), "--out", str(files[seed])]) == 0
    return files


def counts(file) -> dict:
    result = json.loads(file.read_text())
    return {f"{name}/{uid}": c / result["k"] for name, s in result["sets"].items() for uid, c in s["problems"].items()}


def edited(src, dst, change) -> str:
    """A copy of an evaluation file with each per-problem count replaced by change(set, uid, count)."""
    result = json.loads(src.read_text())
    for name, s in result["sets"].items():
        s["problems"] = {uid: change(name, uid, c) for uid, c in s["problems"].items()}
    dst.write_text(json.dumps(result))
    return str(dst)


def test_means_gains_and_the_baseline_difference_are_the_studys(evals, tmp_path):
    # Could fail if problems of two sets were mixed up or paired by position, if a seed's gain were not its file's
    # mean minus the start's (its interval from its own problems), or if the difference from the baseline were not
    # paired by seed and problem.
    start, seeds = evals[0], [evals[1], evals[2]]
    acc = {s: counts(f) for s, f in ((0, evals[0]), (1, evals[1]), (2, evals[2]))}
    keys = problems(json.loads(evals[0].read_text()))  # the order the bootstrap resamples in
    assert sorted(keys) == sorted(acc[0])
    assert len(keys) == 24 and 0 < np.mean(list(acc[0].values())) < 1, "the test needs a policy that solves some"
    # "better": seed 1's file with every cd4 problem solved in all 4 samples (known gain: the cd4 half's shortfall)
    better = edited(evals[1], tmp_path / "better.json", lambda name, uid, c: 4 if name == "cd4" else c)
    result = compare(str(start), {"a": [str(f) for f in seeds], "b": [better, str(evals[2])]}, baseline="a",
                     resamples=2000)
    assert result["measure"] == "mean@4" and result["problems"] == 24
    a = np.array([[acc[s][u] for u in keys] for s in (1, 2)])
    base = np.array([acc[0][u] for u in keys])
    assert result["start"]["mean"] == pytest.approx(base.mean())
    assert result["entries"]["a"]["mean"] == pytest.approx(a.mean())
    by_seed = result["entries"]["a"]["gain_by_seed"]
    assert [g["diff"] for g in by_seed] == pytest.approx([row.mean() - base.mean() for row in a])
    assert by_seed == [hierarchical_bootstrap_diff(row[None], base[None], 2000) for row in a]  # its problems alone
    assert all(g["n_seeds"] == 1 and g["low"] <= g["diff"] <= g["high"] for g in by_seed)
    assert result["entries"]["a"]["gain"] == hierarchical_bootstrap_diff(a, np.stack([base, base]), 2000)
    shortfall = sum(1 - acc[1][u] for u in keys if u.startswith("cd4/")) / 24 / 2  # over 2 seeds x 24 problems
    versus = result["versus"]["b"]
    assert versus["diff"] == pytest.approx(shortfall) and versus["n_seeds"] == 2 and versus["n_prompts"] == 24
    assert versus["low"] <= versus["diff"] <= versus["high"] and "p_holm" in versus and "differs" in versus
    # an entry against itself: no difference at all
    same = compare(str(start), {"a": [str(f) for f in seeds], "c": [str(f) for f in seeds]}, baseline="a",
                   resamples=500)["versus"]["c"]
    assert (same["diff"], same["low"], same["high"], same["differs"]) == (0.0, 0.0, 0.0, False)


def test_the_command_prints_tables_and_writes_json(evals, tmp_path, capsys):
    # Could fail if `bapo compare` were not wired, printed no table, or wrote other numbers than it printed.
    out = tmp_path / "cmp.json"
    assert main(["compare", str(evals[0]), "--entry", f"m={evals[1]},{evals[2]}", "--entry",
                 f"n={evals[2]},{evals[1]}", "--baseline", "m", "--resamples", "500", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert "| start policy |" in text and "| m | 2 |" in text and "| n - m |" in text
    assert f"{result['entries']['m']['mean']:.3f}" in text and result["versus"]["n"]["n_seeds"] == 2


def test_bad_files_get_one_line_naming_the_file(evals, tmp_path, capsys):
    # Could fail if a file of another measure, of fewer problems, unreadable, or an entry of another seed count
    # against the baseline were compared anyway, or refused with a traceback rather than one line naming it.
    fewer = json.loads(evals[1].read_text())
    uid = next(iter(fewer["sets"]["cd4"]["problems"]))
    del fewer["sets"]["cd4"]["problems"][uid]
    (tmp_path / "fewer.json").write_text(json.dumps(fewer))
    (tmp_path / "bad.json").write_text("{not json")
    cases = [([f"--entry=m={evals['greedy']}"], ["greedy.json", "greedy", "mean@4"]),
             ([f"--entry=m={tmp_path / 'fewer.json'}"], ["fewer.json", uid, "cd4"]),
             ([f"--entry=m={tmp_path / 'bad.json'}"], ["bad.json", "not a readable evaluation JSON"]),
             ([f"--entry=m={evals[1]},{evals[2]}", f"--entry=n={evals[1]}", "--baseline", "m"],
              ["n", "paired by seed"]),
             ([f"--entry=m={evals[1]}", "--baseline", "x"], ["--baseline x", "not an entry"]),
             ([f"--entry=m{evals[1]}"], ["NAME=FILE"])]
    for args, words in cases:
        assert main(["compare", str(evals[0]), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), (args, err)
