"""The study of issue 13 on CPU: the hard-set metric against a hand-computed case, the max_rollouts stop (and its
resume, which the study's checkpoints rely on), and a tiny grid (2 algorithms x 2 seeds, the bundled policy) that
must write its table and plots with every run stopped at the same rollout budget. Nothing is mocked."""
import dataclasses
import json
import sqlite3
from pathlib import Path

import pytest
import torch

from bapo_vl.cli import main as bapo
from bapo_vl.config import Config, load_config
from bapo_vl.study import (KNOBS, StudyOptions, bin_changes, child_argv, coarse, hard_set, main, migration,
                            parse_args, targets, unlocked, within_noise)

SMALL = ["batch_size=4", "group_size=4", "task_options={template: compact, limit: 64}"]  # 64 training prompts


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny policy gains nothing from a second thread, and on a busy 2-core machine spinning threads are several
    times slower (measured: 113 s -> 26 s for a one-run study)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def steps_rollouts(run_dir: Path) -> list[int]:
    return [m["rollouts"] for m in step_metrics(run_dir)]


def step_metrics(run_dir: Path) -> list[dict]:
    """Each step's metrics but its timings (what must match between two runs of one seed)."""
    db = sqlite3.connect(run_dir / "run.db")
    try:
        rows = [json.loads(m) for (m,) in db.execute("SELECT metrics FROM steps ORDER BY step")]
    finally:
        db.close()
    return [{k: v for k, v in m.items() if not k.startswith("t_")} for m in rows]


def test_hard_set_unlocked_and_migration_by_hand():
    # k = 4. Start: a 0/4, b 0/4, c 2/4, d 4/4, e 0/4 -> hard set {a, b, e}. End: a 1/4, b 0/4, c 3/4, d 4/4, e 4/4
    # -> a and e are solved at least once, b is not: unlocked = 2/3. c and d were never hard and do not count.
    start = {"a": 0, "b": 0, "c": 2, "d": 4, "e": 0}
    end = {"a": 1, "b": 0, "c": 3, "d": 4, "e": 4}
    hard = hard_set(start)
    assert hard == ["a", "b", "e"]
    assert unlocked(hard, end) == pytest.approx(2 / 3)
    assert unlocked(hard, start) == 0.0  # the start policy with the same samples unlocks nothing, by definition
    assert unlocked([], end) == 0.0
    m = migration(start, end, k=4)  # m[start bin][end bin]
    expected = [[0] * 5 for _ in range(5)]
    expected[0][0] = 1  # b
    expected[0][1] = 1  # a
    expected[0][4] = 1  # e
    expected[2][3] = 1  # c
    expected[4][4] = 1  # d
    assert m == expected
    labels, c = coarse(m)  # bins 0 | 1 | 2..3 | 4 for k = 4
    assert labels == ["0/k", "<1/2", ">=1/2", "k/k"]
    assert c == [[1, 1, 0, 1], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    with pytest.raises(ValueError, match="'e' was not evaluated"):  # a hard prompt missing from a later evaluation
        unlocked(hard, {"a": 1, "b": 0})
    # mean change of correct/4 by start bin: 0/k {b: 0, a: +1, e: +4} -> 5/12; <1/2 empty; >=1/2 {c: +1} -> 1/4;
    # k/k {d: 0} -> 0
    assert bin_changes(m) == [pytest.approx(5 / 12), None, pytest.approx(1 / 4), 0.0]


def test_within_noise_rule():
    # means 0.2 vs 0.3, sd 0.1 each, 3 seeds: 2 SE of the difference = 2 * sqrt(2 * 0.01 / 3) = 0.163 > 0.1
    assert within_noise([0.1, 0.2, 0.3], [0.2, 0.3, 0.4]) is True
    assert within_noise([0.10, 0.11, 0.12], [0.30, 0.31, 0.32]) is False  # 0.2 apart, sd 0.01: not noise
    assert within_noise([0.1], [0.3, 0.4]) is None  # one seed: no noise estimate, no call


def test_knob_entries_each_change_one_of_bapos_defaults():
    # Could fail if BAPO's defaults moved (then "bapo" would no longer be v=5, m=5, range, age 3 in the study) or a
    # knob entry changed more than its knob.
    cfg = Config()
    assert (cfg.delay, cfg.reeval_every, cfg.online_filter, cfg.high_max_age) == (5, 5, "range", 3)
    bapo_cfg = load_config(None, None, ["algo=bapo"]).to_dict()
    for name, overrides in KNOBS.items():
        changed = {k for k, v in load_config(None, None, overrides).to_dict().items() if bapo_cfg[k] != v}
        assert len(changed) == 1, (name, changed)


def test_study_options_refuse_what_the_study_sets():
    with pytest.raises(ValueError, match="seed=3"):
        StudyOptions(overrides=["seed=3"])
    with pytest.raises(ValueError, match="unknown grid entries"):
        StudyOptions(algos=["bapo", "ppo"])


def test_max_rollouts_stops_after_the_step_that_reaches_it_and_resumes_to_the_same_run(tmp_path):
    # BAPO with re-evaluations every 2 steps: steps generate 16 or more rollouts. Could fail if the stop came a step
    # early or late, if re-evaluation rollouts were not counted, or if a budget raised on resume did not continue
    # the same run (the study evaluates its checkpoints that way).
    args = [*SMALL, "algo=bapo", "reeval_every=2", "c1=0.25", "steps=40", "seed=3"]
    assert bapo(["train", "--quiet", f"run_dir={tmp_path}", "name=whole", *args, "max_rollouts=70"]) == 0
    whole = steps_rollouts(tmp_path / "whole")
    assert sum(whole[:-1]) < 70 <= sum(whole)  # stopped after the first step that reached the budget
    assert any(r > 16 for r in whole)  # re-evaluations were counted
    assert sorted(p.name for p in (tmp_path / "whole" / "checkpoints").iterdir()) == [f"step_{len(whole)}"]

    assert bapo(["train", "--quiet", f"run_dir={tmp_path}", "name=split", *args, "max_rollouts=30"]) == 0
    first = steps_rollouts(tmp_path / "split")
    assert sum(first[:-1]) < 30 <= sum(first) and len(first) < len(whole)
    assert bapo(["train", "--quiet", f"resume={tmp_path / 'split'}", "max_rollouts=30"]) == 0  # already spent
    assert steps_rollouts(tmp_path / "split") == first
    assert bapo(["train", "--quiet", f"resume={tmp_path / 'split'}", "max_rollouts=70"]) == 0
    assert step_metrics(tmp_path / "split") == step_metrics(tmp_path / "whole")  # rewards, losses, X1/X2/X3 sizes


def test_small_study_writes_table_and_plots_at_one_budget(tmp_path, capsys):
    # Could fail if a run did not stop at the budget (too early, or a step too late), if an entry were missing from
    # the table, if the plots were not written, or if running the same command again trained anything again.
    runs, out = tmp_path / "runs", tmp_path / "out"
    argv = ["--algos", "grpo,bapo", "--seeds", "0,1", "--budget", "40", "--checkpoints", "2", "--k", "4",
            "--limit", "8", "--runs", str(runs), "--out", str(out), *SMALL]
    assert main(argv) == 0
    assert "grpo seed 1: " in capsys.readouterr().err
    table = (out / "results.md").read_text()
    for word in ("| grpo |", "| bapo |", "| start policy |", "hard set unlocked", "mean@4", "pass@4",
                 "Against grpo", "python scripts/study.py --algos grpo,bapo"):
        assert word in table, word
    for png in ("accuracy.png", "unlocked.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    result = json.loads((out / "results.json").read_text())
    assert {(r["entry"], r["seed"], r["budget"]) for r in result["runs"]} == {
        (e, s, b) for e in ("grpo", "bapo") for s in (0, 1) for b in (20, 40)}
    for entry in ("grpo", "bapo"):
        for seed in (0, 1):
            run_dir = runs / f"{entry}-s{seed}"
            spent = steps_rollouts(run_dir)
            assert sum(spent[:-1]) < 40 <= sum(spent), (entry, seed, spent)  # the same budget, the same rule
            final = [r for r in result["runs"] if (r["entry"], r["seed"], r["budget"]) == (entry, seed, 40)][0]
            assert final["rollouts"] == sum(spent) and final["step"] == len(spent)
            recorded = json.loads(sqlite3.connect(run_dir / "run.db").execute("SELECT json FROM config").fetchone()[0])
            assert recorded["algo"] == entry and recorded["seed"] == seed
            # every checkpoint's evaluation is also in the run's own record, at the step it saw
            db = sqlite3.connect(run_dir / "run.db")
            evals = {(s, n, m): v for s, n, m, v in db.execute("SELECT step, name, metric, value FROM evals")}
            db.close()
            for r in [r for r in result["runs"] if (r["entry"], r["seed"]) == (entry, seed)]:
                assert evals[(r["step"], "hard_set", "unlocked_fraction")] == pytest.approx(r["unlocked"])
                assert evals[(r["step"], "hard_set", "hard_set_size")] == result["hard_set"]
                assert evals[(r["step"], "hard_set", "k")] == 4
                for m in ("greedy", "mean@k", "pass@k"):
                    assert evals[(r["step"], "heldout", m)] == pytest.approx(r[m]), m
            assert len(evals) == 2 * (3 + 4)  # two checkpoints: none lost to the resume between them
    # the table's steps: each entry's mean updates over seeds (equal rollouts need not be equal updates)
    lines = table.splitlines()
    head = [c.strip() for c in next(x for x in lines if x.startswith("| | greedy")).split("|")]
    for entry in ("grpo", "bapo"):
        row = [c.strip() for c in next(x for x in lines if x.startswith(f"| {entry} |")).split("|")]
        steps = [r["step"] for r in result["runs"] if r["entry"] == entry and r["budget"] == 40]
        assert float(row[head.index("steps")].split(" ± ")[0]) == pytest.approx(sum(steps) / len(steps), abs=0.5)
    ledger = (runs / "study.jsonl").read_text()
    assert main(argv) == 0  # everything is in the ledger: nothing is trained or evaluated again
    assert (runs / "study.jsonl").read_text() == ledger
    assert "rollouts at step" not in capsys.readouterr().err


def ledger_rows(path: Path) -> list[dict]:
    """The ledger's evaluations (its first line is the settings), each with its timing dropped."""
    return [{k: v for k, v in json.loads(line).items() if k != "train_seconds"}
            for line in path.read_text().splitlines()[1:]]


def test_jobs_runs_every_entry_and_seed_in_its_own_process_with_the_sequential_numbers(tmp_path, capsys):
    # Could fail if a child missed one of the parent's settings (its ledger would be refused, or its numbers would
    # differ), if two children's ledger lines interleaved or a row were written twice, if a child's run were not
    # the seeded run the sequential study trains, or if the report were not written from the children's rows.
    def argv(name, jobs):
        return ["--algos", "grpo,bapo", "--seeds", "0", "--budget", "40", "--checkpoints", "2", "--k", "4",
                "--limit", "8", "--runs", str(tmp_path / name), "--out", str(tmp_path / f"{name}-out"),
                "--jobs", str(jobs), *SMALL]

    assert main(argv("sequential", 1)) == 0
    assert main(argv("parallel", 2)) == 0
    err = capsys.readouterr().err
    logs = tmp_path / "parallel" / "logs"
    for entry in ("grpo", "bapo"):
        assert f"{entry} seed 0: rc 0, " in err, entry
        assert "rollouts at step" in (logs / f"{entry}-s0.log").read_text()  # the child's own output
        assert step_metrics(tmp_path / "parallel" / f"{entry}-s0") == step_metrics(tmp_path / "sequential" /
                                                                                  f"{entry}-s0")
    rows = ledger_rows(tmp_path / "parallel" / "study.jsonl")
    keys = [(r["entry"], r["seed"], r["budget"]) for r in rows]
    assert sorted(keys, key=str) == sorted([("start", None, 0), ("start_resampled", None, 0),
                                            *((e, 0, b) for e in ("grpo", "bapo") for b in (20, 40))], key=str)
    by_key = lambda rs: {(r["entry"], r["seed"], r["budget"]): r for r in rs}
    assert by_key(rows) == by_key(ledger_rows(tmp_path / "sequential" / "study.jsonl"))  # every count, every score
    results = [json.loads((tmp_path / f"{name}-out" / "results.json").read_text()) for name in ("sequential",
                                                                                               "parallel")]
    for r in results:
        for row in r["runs"]:
            del row["train_seconds"]
    assert results[0]["runs"] == results[1]["runs"] and results[0]["hard_set"] == results[1]["hard_set"]
    assert "| bapo |" in (tmp_path / "parallel-out" / "results.md").read_text()


def test_jobs_names_every_failed_run_and_its_log_and_continues_from_the_ledger(tmp_path, capsys):
    # A file where grpo seed 1's run directory belongs: that child fails when training starts, seed 0's runs.
    # Could fail if a failed child went unreported or unnamed, if the parent stopped waiting for the others, if it
    # wrote a report without every run, or if the rows written were lost (the same command again must continue).
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    (runs / "grpo-s1").write_text("not a run directory")
    argv = ["--algos", "grpo", "--seeds", "0,1", "--budget", "40", "--checkpoints", "2", "--k", "4", "--limit", "8",
            "--runs", str(runs), "--out", str(out), "--jobs", "2", *SMALL]
    with pytest.raises(RuntimeError, match="1 of 2 study runs failed") as failure:
        main(argv)
    log = runs / "logs" / "grpo-s1.log"
    assert f"grpo seed 1 (log {log})" in str(failure.value) and "grpo seed 0" not in str(failure.value)
    assert "FileExistsError" in log.read_text()  # the child's own traceback
    assert "grpo seed 0: rc 0, " in capsys.readouterr().err
    assert not out.exists()
    done = {(r["entry"], r["seed"], r["budget"]) for r in ledger_rows(runs / "study.jsonl")}
    assert {("grpo", 0, 20), ("grpo", 0, 40)} <= done and not any(key[1] == 1 for key in done)

    (runs / "grpo-s1").unlink()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "grpo seed 1: rc 0, " in err and "grpo seed 0: rc" not in err  # seed 0 was done: not started again
    assert len(ledger_rows(runs / "study.jsonl")) == 2 + 2 * 2
    assert "FileExistsError" in log.read_text() and "rollouts at step" in log.read_text()  # both attempts
    assert (out / "results.md").exists()


def test_hard_set_target_is_no_evidence_under_the_resampling_floor():
    # Could fail if a 1.5x ratio of two figures that resampling the start policy alone beats were called "met".
    opts = StudyOptions(algos=["grpo", "bapo"], seeds=[0], budget=10, checkpoints=1, k=4)

    def result(bapo, grpo, floor):
        runs = [{"entry": e, "seed": 0, "budget": 10, "mean@k": 0.2, "unlocked": u, "rollouts": 10}
                for e, u in (("bapo", bapo), ("grpo", grpo))]
        return {"settings": {"budget": 10}, "resampled": {"unlocked": floor}, "runs": runs}

    line = lambda r: next(x for x in targets(r, opts) if "hard set unlocked" in x)  # noqa: E731
    assert "-> met;" in line(result(0.30, 0.10, floor=0.05))
    assert "met on paper, but no evidence" in line(result(0.03, 0.01, floor=0.11))
    assert "-> not met;" in line(result(0.12, 0.10, floor=0.05))


def test_a_ledger_from_before_a_new_config_field_still_opens(tmp_path):
    # Could fail if adding a Config field (at its default) made every existing study ledger "made with other
    # settings", or if a ledger whose recorded value differs from today's were accepted.
    from bapo_vl.study import Ledger

    settings = json.loads(json.dumps({"config": Config().to_dict(), "k": 4}))
    older = {**settings, "config": {k: v for k, v in settings["config"].items() if k != "vllm_options"}}
    path = tmp_path / "study.jsonl"
    path.write_text(json.dumps(older) + "\n" + json.dumps({"entry": "grpo", "seed": 0, "budget": 8}) + "\n")
    assert Ledger(path, settings).get("grpo", 0, 8) == {"entry": "grpo", "seed": 0, "budget": 8}
    other = {**older, "config": {**older["config"], "lr": 0.5}}
    path.write_text(json.dumps(other) + "\n")
    with pytest.raises(ValueError, match="made with other settings"):
        Ledger(path, settings)


def test_a_jobs_child_gets_every_setting_of_the_study():
    # Could fail if a StudyOptions field were added to the command line but not passed on by child_argv: the
    # children of --jobs would then train or evaluate with its default, and their rows would not match the parent's.
    opts = StudyOptions(algos=["grpo", "bapo"], seeds=[3, 4], budget=77, checkpoints=3, k=5, split="val",
                        source="held.jsonl", limit=9, preset="tiny", overrides=["device=cpu", "lr=1e-5"],
                        runs="somewhere", out="elsewhere", eval_seed=7, eval_batch_size=11, baseline="bapo",
                        keep_checkpoints=True, jobs=2)
    argv = child_argv(opts, "bapo", 4)
    assert argv[1:3] == ["-m", "bapo_vl.study"]
    child = parse_args(argv[3:])
    own = {"algos": ["bapo"], "seeds": [4], "jobs": 1, "report": False}  # what a child does differently
    unused = {"out", "baseline", "command", "knobs"}  # only the report reads them (children write none)
    for f in dataclasses.fields(StudyOptions):
        if f.name in unused:
            continue
        assert getattr(child, f.name) == own.get(f.name, getattr(opts, f.name)), f.name


def test_one_policy_load_gives_what_two_bapo_eval_calls_give():
    # Could fail if sharing one loaded policy between the sampled and the greedy pass changed a number (the random
    # state the sampled pass starts from, the greedy pass's settings) against two separate `bapo eval` runs.
    from bapo_vl.evaluate import EvalOptions, run_eval
    from bapo_vl.study import evaluate_policy

    opts = StudyOptions(k=4, limit=8)
    cfg = load_config(overrides=[*SMALL, "device=cpu"])
    row = evaluate_policy(opts, cfg, cfg.model, None, seed=5)
    common = dict(model=cfg.model, task=cfg.task, splits=[opts.split], template="compact", limit=8, seed=5,
                  max_new_tokens=cfg.max_response_length, device="cpu", quiet=True)
    sampled = run_eval(EvalOptions(**common, k=4, temperature=1.0))["sets"][opts.split]
    greedy = run_eval(EvalOptions(**common, k=1, temperature=0.0))["sets"][opts.split]
    assert row == {"greedy": greedy["mean@k"], "mean@k": sampled["mean@k"], "pass@k": sampled["pass@k"],
                   "n": sampled["n"], "counts": sampled["problems"]}
