"""The study on CPU: the hard-set metric against a hand-computed case, the max_rollouts stop (and its resume, which
the study's checkpoints rely on), tiny grids (the bundled policy) that must write their tables and plots with every
run stopped at the same rollout budget, and the report's statistics on constructed ledgers whose verdicts are known.
Nothing is mocked."""
import dataclasses
import json
import math
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from bapo_vl.cli import main as bapo
from bapo_vl.config import Config, load_config
from bapo_vl.provenance import commit
from bapo_vl.record import read_meta
from bapo_vl.study import (KNOBS, StudyOptions, analyse, bin_changes, brief, checkpoint_budgets, child_argv, coarse,
                            codes_of_runs, extended_budgets, final_rows, hard_set, main, migration, parse_args, plot,
                            refuse_sleeping_engines_sharing_a_card, report, restarted_runs, unlocked)

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


def test_knob_entries_each_change_one_of_bapos_defaults():
    # Could fail if BAPO's defaults moved (then "bapo" would no longer be v=5, m=5, range, age 3 in the study) or a
    # knob entry changed more than its knob.
    cfg = Config()
    bapo = cfg.bapo
    assert (bapo.delay, bapo.reeval_every, bapo.online_filter, bapo.high_max_age) == (5, 5, "range", 3)
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
            "--limit", "8", "--runs", str(runs), "--out", str(out), *SMALL, "reeval_every=1"]  # BAPO re-evaluates
    assert main(argv) == 0
    assert "grpo seed 1: " in capsys.readouterr().err
    table = (out / "results.md").read_text()
    for word in ("| grpo |", "| bapo |", "| start policy |", "hard set unlocked", "mean@4", "pass@4",
                 "Against grpo", "## Targets", "## Gain over the start policy", "optimizer steps",
                 "python scripts/study.py --algos grpo,bapo"):
        assert word in table, word
    for png in ("accuracy.png", "updates.png", "unlocked.png", "forest.png"):
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
            # where they went: the run's own step metrics summed, fresh and re-evaluation adding up to the rollouts
            metrics = step_metrics(run_dir)
            assert final["spent"] == {name: sum(m[key] for m in metrics) for name, key in
                                      (("fresh", "rollouts_fresh"), ("reevaluated", "rollouts_reevaluated"),
                                       ("x1", "x1"), ("x2", "x2"), ("x3", "x3"))}
            assert final["spent"]["fresh"] + final["spent"]["reevaluated"] == final["rollouts"]
            if entry == "grpo":
                assert final["spent"]["reevaluated"] == final["spent"]["x2"] == final["spent"]["x3"] == 0
            else:
                assert final["spent"]["reevaluated"] > 0
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
    head = [c.strip() for c in next(x for x in lines if x.startswith("| | mean@4")).split("|")]
    for entry in ("grpo", "bapo"):
        row = [c.strip() for c in next(x for x in lines if x.startswith(f"| {entry} |")).split("|")]
        steps = [r["step"] for r in result["runs"] if r["entry"] == entry and r["budget"] == 40]
        assert float(row[head.index("steps")].split(" ± ")[0]) == pytest.approx(sum(steps) / len(steps), abs=0.5)
    # the spending table: each entry's means over seeds, and the rollouts per group of its batches
    spending = lines[lines.index("## Where the rollouts went (40 rollouts)"):]
    for entry in ("grpo", "bapo"):
        cells = [c.strip() for c in next(x for x in spending if x.startswith(f"| {entry} |")).split("|")]
        rows = [r["spent"] for r in result["runs"] if r["entry"] == entry and r["budget"] == 40]
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
        assert float(cells[2].replace(",", "")) == pytest.approx(mean["fresh"], abs=0.5)
        assert float(cells[3].replace(",", "")) == pytest.approx(mean["reevaluated"], abs=0.5)
        groups = mean["x1"] + mean["x2"] + mean["x3"]
        assert float(cells[5]) == pytest.approx((mean["fresh"] + mean["reevaluated"]) / groups, abs=0.05)
    ledger = (runs / "study.jsonl").read_text()
    assert main(argv) == 0  # everything is in the ledger: nothing is trained or evaluated again
    assert (runs / "study.jsonl").read_text() == ledger
    assert "rollouts at step" not in capsys.readouterr().err


def ledger_rows(path: Path, drop=("train_seconds", "run")) -> list[dict]:
    """The ledger's evaluations (its first line is the settings), each with its timing and run record dropped."""
    return [{k: v for k, v in json.loads(line).items() if k not in drop}
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
    # the start policy evaluated in a process of its own (this one holds no model while the runs share the cards)
    assert "start policy: rc 0, " in err and "evaluating the start policy" in (logs / "start.log").read_text()
    assert err.count("evaluating the start policy") == 2  # the sequential study's own two (start, start_hard)
    for entry in ("grpo", "bapo"):
        assert f"{entry} seed 0: rc 0, " in err, entry
        assert "rollouts at step" in (logs / f"{entry}-s0.log").read_text()  # the child's own output
        assert step_metrics(tmp_path / "parallel" / f"{entry}-s0") == step_metrics(tmp_path / "sequential" /
                                                                                  f"{entry}-s0")
    rows = ledger_rows(tmp_path / "parallel" / "study.jsonl")
    keys = [(r["entry"], r["seed"], r["budget"]) for r in rows]
    assert sorted(keys, key=str) == sorted([("start", None, 0), ("start_final", None, 0), ("start_hard", None, 0),
                                            *((e, 0, b) for e in ("grpo", "bapo") for b in (20, 40))], key=str)
    by_key = lambda rs: {(r["entry"], r["seed"], r["budget"]): r for r in rs}
    assert by_key(rows) == by_key(ledger_rows(tmp_path / "sequential" / "study.jsonl"))  # every count, every score
    results = [json.loads((tmp_path / f"{name}-out" / "results.json").read_text()) for name in ("sequential",
                                                                                               "parallel")]
    for r in results:
        for row in r["runs"]:
            del row["train_seconds"], row["run"]  # the same seeded runs, trained twice
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
    assert len(ledger_rows(runs / "study.jsonl")) == 3 + 2 * 2  # start, start_final, start_hard; 2 x 2 runs
    assert "FileExistsError" in log.read_text() and "rollouts at step" in log.read_text()  # both attempts
    assert (out / "results.md").exists()


def test_jobs_sharing_a_card_between_sleeping_vllm_engines_are_refused_before_any_work(tmp_path):
    # Could fail if the study started runs whose vLLM engines share a card with sleep mode on (on a GPU two of six
    # such runs died mid-training on vLLM's "Memory usage increased after sleeping"), if the refusal came after the
    # start evaluations (a ledger written), or if it refused what is safe: one job, or engines without sleep mode.
    runs = tmp_path / "runs"
    argv = ["--algos", "grpo", "--seeds", "0,1", "--budget", "40", "--checkpoints", "2", "--k", "4", "--limit", "8",
            "--runs", str(runs), "--out", str(tmp_path / "out"), "--jobs", "2", "rollout_engine=vllm", *SMALL]
    with pytest.raises(ValueError) as refused:
        main(argv)
    message = str(refused.value)
    assert "--jobs 2 on 1 card(s) puts 2 vLLM engines on a card" in message and "\n" not in message
    assert "pass --jobs 1" in message and "enable_sleep_mode: false" in message
    assert not runs.exists()
    for safe in (["--jobs", "1"], ["vllm_options={enable_sleep_mode: false}"], ["rollout_engine=transformers"]):
        opts = parse_args([*argv, *safe])
        refuse_sleeping_engines_sharing_a_card(opts, load_config(None, None, opts.overrides))  # no error


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


def test_a_ledger_gains_entries_and_extensions_but_never_changes_them(tmp_path):
    # Could fail if a study could not grow by an entry (its earlier runs retrained or the ledger refused), if the
    # first line did not come to name the new entry (a later command would read its rows as foreign), or if an
    # entry or extension named again with other overrides or budgets were accepted: its rows would mean two things.
    from bapo_vl.study import Ledger

    base = json.loads(json.dumps({"config": Config().to_dict(), "k": 4, "entries": {"a": ["lr=1e-5"]},
                                  "extend": {"grpo": [64]}}))
    path = tmp_path / "study.jsonl"
    row = {"entry": "a", "seed": 0, "budget": 8}
    path.write_text(json.dumps(base) + "\n" + json.dumps(row) + "\n")
    more = {**base, "entries": {"b": ["lr=1e-4"], "a": ["lr=1e-5"]}, "extend": {"bapo": [64]}}
    assert Ledger(path, more).get("a", 0, 8) == row
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["entries"] == {"a": ["lr=1e-5"], "b": ["lr=1e-4"]}
    assert json.loads(lines[0])["extend"] == {"bapo": [64], "grpo": [64]} and json.loads(lines[1]) == row
    assert Ledger(path, base).get("a", 0, 8) == row  # a command naming fewer entries still reads them all
    for changed in ({**base, "entries": {"a": ["lr=1e-4"]}}, {**base, "extend": {"grpo": [128]}},
                    {**more, "k": 8}):
        with pytest.raises(ValueError, match="not change them"):
            Ledger(path, changed)
    assert json.loads(path.read_text().splitlines()[0])["entries"] == {"a": ["lr=1e-5"], "b": ["lr=1e-4"]}


def test_a_jobs_child_gets_every_setting_of_the_study():
    # Could fail if a StudyOptions field were added to the command line but not passed on by child_argv: the
    # children of --jobs would then train or evaluate with its default, and their rows would not match the parent's.
    entries = {"lr1e-5_kl0": ["algo=grpo", "lr=1e-5", "kl_coef=0"],
               "spaced": ["algo=bapo", "task_options={template: compact, limit: 64}"]}
    opts = StudyOptions(algos=["grpo", "bapo", "spaced"], seeds=[3, 4], budget=77, checkpoints=3, spacing="linear",
                        k=5, final_k=9, hard_k=13, extend={"grpo": 2.5, "lr1e-5_kl0": 2.0}, entries=entries,
                        split="val", source="held.jsonl", limit=9, preset="tiny", overrides=["device=cpu", "lr=1e-5"],
                        runs="somewhere", out="elsewhere", eval_seed=7, eval_batch_size=11, baseline="bapo",
                        keep_checkpoints=True, jobs=2)
    argv = child_argv(opts, "spaced", 4)
    assert argv[1:3] == ["-m", "bapo_vl.study"]
    child = parse_args(argv[3:])
    own = {"algos": ["spaced"], "seeds": [4], "jobs": 1, "report": False}  # what a child does differently
    unused = {"out", "baseline", "command", "knobs", "by"}  # only the report reads them (children write none)
    for f in dataclasses.fields(StudyOptions):
        if f.name in unused:
            continue
        assert getattr(child, f.name) == own.get(f.name, getattr(opts, f.name)), f.name


def test_overrides_may_come_before_and_after_options():
    # Could fail if an option after the key=value overrides ended the parse ("unrecognized arguments"): growing a
    # study by adding `--extend grpo=2` at the end of its command must work.
    opts = parse_args(["--seeds", "0", "device=cpu", "--extend", "grpo=2", "lr=1e-5", "--budget", "64"])
    assert (opts.overrides, opts.extend, opts.seeds, opts.budget) == (["device=cpu", "lr=1e-5"], {"grpo": 2.0}, [0], 64)


def test_one_policy_load_gives_what_two_bapo_eval_calls_give():
    # Could fail if sharing one loaded policy between the sampled and the greedy pass changed a number (the random
    # state the sampled pass starts from, the greedy pass's settings) against two separate `bapo eval` runs.
    from bapo_vl.evaluate import EvalOptions, run_eval
    from bapo_vl.study import evaluate_policy

    opts = StudyOptions(k=4, limit=8)
    cfg = load_config(overrides=[*SMALL, "device=cpu"])
    row = evaluate_policy(opts, cfg, cfg.run.model, None, seed=5)
    common = dict(model=cfg.run.model, task=cfg.run.task, splits=[opts.split], template="compact", limit=8, seed=5,
                  max_new_tokens=cfg.sampling.max_response_length, device="cpu", quiet=True)
    sampled = run_eval(EvalOptions(**common, k=4, temperature=1.0))["sets"][opts.split]
    greedy = run_eval(EvalOptions(**common, k=1, temperature=0.0))["sets"][opts.split]
    assert row == {"greedy": greedy["mean@k"], "greedy_counts": greedy["problems"], "mean@k": sampled["mean@k"],
                   "pass@k": sampled["pass@k"], "n": sampled["n"], "counts": sampled["problems"]}


def test_several_held_out_splits_are_one_pool_of_prompts():
    # Could fail if a second split were dropped or evaluated apart (its prompts missing from the counts the
    # intervals pair by), if --limit cut the pool instead of each split, or if a split named twice were accepted.
    from bapo_vl.evaluate import EvalOptions, run_eval
    from bapo_vl.study import evaluate_policy

    opts = StudyOptions(k=2, limit=3, split="test,cd4")
    cfg = load_config(overrides=[*SMALL, "device=cpu"])
    row = evaluate_policy(opts, cfg, cfg.run.model, None, seed=5)
    greedy = run_eval(EvalOptions(model=cfg.run.model, task=cfg.run.task, splits=["test", "cd4"], template="compact",
                                  limit=3, seed=5, max_new_tokens=cfg.sampling.max_response_length, device="cpu",
                                  quiet=True, k=1, temperature=0.0))["sets"]
    assert row["n"] == 6 and set(row["counts"]) == set(row["greedy_counts"])
    assert row["greedy_counts"] == {**greedy["test"]["problems"], **greedy["cd4"]["problems"]}  # 3 + 3 uids
    assert row["greedy"] == pytest.approx((greedy["test"]["mean@k"] + greedy["cd4"]["mean@k"]) / 2)
    for bad in ("test,test", "test,"):
        with pytest.raises(ValueError, match="each once"):
            StudyOptions(split=bad)


def test_evaluations_build_the_rollout_engine_the_training_segments_build():
    # Could fail if the study's evaluations fell back to `bapo eval`'s defaults (rollout_engine auto, no
    # vllm_options): in one process they take over vLLM's one engine from the training segments, which refuses other
    # settings (bapo_vl.backends.engines.process_engine), so a study with vllm_options stopped at its first
    # evaluation after training. The start policy's evaluation (a model path, a preset's defaults) and a run's.
    from bapo_vl.evaluate import EvalOptions
    from bapo_vl.study import eval_setup

    engine = ["rollout_engine=transformers", "vllm_options={gpu_memory_utilization: 0.13, enforce_eager: true}"]
    cfg = load_config(overrides=[*SMALL, "device=cpu", *engine])
    common = dict(task=cfg.run.task, splits=["test"], limit=4, device="cpu", quiet=True)
    s = eval_setup(cfg, EvalOptions(model=cfg.run.model, **common))
    assert s.cfg.embedded.rollout_engine == "transformers"
    assert s.cfg.embedded.vllm_options == {"gpu_memory_utilization": 0.13, "enforce_eager": True}
    plain = eval_setup(load_config(overrides=[*SMALL, "device=cpu"]), EvalOptions(model=cfg.run.model, **common))
    assert plain.cfg.embedded.rollout_engine == "auto" and plain.cfg.embedded.vllm_options == {}


def test_log_spaced_checkpoints_and_extended_budgets():
    # Could fail if log spacing were not geometric up to the budget, if rounding produced a 0 or a duplicate
    # checkpoint, if linear spacing changed, or if an extended entry's checkpoints did not continue the spacing
    # up to exactly factor x budget.
    assert checkpoint_budgets(30720, 6) == [960, 1920, 3840, 7680, 15360, 30720]  # budget/32 ... budget
    assert checkpoint_budgets(30720, 4, "linear") == [7680, 15360, 23040, 30720]
    assert checkpoint_budgets(40, 6) == [1, 3, 5, 10, 20, 40]  # 1.25 -> 1, 2.5 -> 3 (half up), then exact
    assert checkpoint_budgets(4, 6) == [1, 2, 4]  # 4/32, 4/16 -> 1 merged: no duplicates, none below 1
    assert checkpoint_budgets(40, 1) == [40]
    opts = StudyOptions(algos=["grpo", "dapo"], budget=1000, checkpoints=3, extend={"dapo": 4})
    assert opts.budgets == opts.entry_budgets("grpo") == [250, 500, 1000]
    assert opts.entry_budgets("dapo") == [250, 500, 1000, 2000, 4000]
    assert [b for b in opts.entry_budgets("dapo") if opts.is_final("dapo", b)] == [1000, 4000]
    assert [b for b in opts.entry_budgets("grpo") if opts.is_final("grpo", b)] == [1000]
    assert extended_budgets(1000, 3, "log", 3) == [2000, 3000]  # stops at exactly 3 x budget
    assert extended_budgets(1000, 4, "linear", 2) == [1250, 1500, 1750, 2000]
    assert (opts.k, opts.final_k, opts.hard_k) == (8, 8, 8)  # final_k defaults to k, hard_k to final_k
    assert opts.final_seed == opts.checkpoint_seed == 1 and opts.hard_seed == 1000
    other = StudyOptions(k=4, final_k=16, eval_seed=5)
    assert (other.hard_k, other.checkpoint_seed, other.final_seed, other.hard_seed) == (16, 6, 7, 1005)
    with pytest.raises(ValueError, match="factors must be > 1"):
        StudyOptions(extend={"dapo": 1})
    with pytest.raises(ValueError, match="--extend names unknown entries"):
        StudyOptions(extend={"ppo": 2})


def test_custom_entries_join_the_grid_and_may_not_replace_a_built_in_one():
    # Could fail if --entry did not add its entry (with its overrides) to the default grid, if a name of a built-in
    # entry could be redefined (its rows would silently mean something else), or if an entry could set what the
    # study sets per run.
    opts = parse_args(["--entry", "lr1e-5_kl0=algo=grpo lr=1e-5 kl_coef=0", "--extend", "lr1e-5_kl0=2"])
    assert opts.algos[-1] == "lr1e-5_kl0" and "grpo" in opts.algos
    assert opts.overrides_of("lr1e-5_kl0") == ["algo=grpo", "lr=1e-5", "kl_coef=0"]
    assert opts.extend == {"lr1e-5_kl0": 2.0}
    assert parse_args(["--algos", "grpo", "--entry", "x=algo=grpo"]).algos == ["grpo"]  # --algos names the grid
    for name in ("dapo", "bapo_v1", "start_hard"):
        with pytest.raises(ValueError, match="built-in entry"):
            parse_args(["--entry", f"{name}=algo=grpo lr=1e-5"])
    with pytest.raises(ValueError, match="the study sets seed"):
        StudyOptions(entries={"mine": ["algo=grpo", "seed=3"]})
    with pytest.raises(ValueError, match="run folders"):
        StudyOptions(entries={"my entry": ["algo=grpo"]})


def test_three_start_evaluations_final_k_extension_custom_entry_and_optimizer_steps(tmp_path):
    # Could fail if the hard set came from any start evaluation but start_hard, if a final row were not at final_k
    # (with its curve point at k) or a checkpoint row not at k, if the evaluations of one k did not share one seed,
    # if the extended entry stopped at the budget or a custom entry's overrides did not reach its run, if a row
    # lacked its optimizer steps, or if a ledger of other settings were reused. The study grows: grpo first, then
    # the same command with the custom entry added trains only that one (grpo's rows and run stay as they were).
    runs, out = tmp_path / "runs", tmp_path / "out"
    common = ["--extend", "grpo=2", "--seeds", "0", "--budget", "32", "--checkpoints", "2", "--k", "2", "--final-k",
              "4", "--hard-k", "3", "--limit", "8", "--eval-seed", "5", "--runs", str(runs), "--out", str(out), *SMALL]
    assert main(["--algos", "grpo", *common]) == 0
    first = ledger_rows(runs / "study.jsonl")
    grpo_steps = step_metrics(runs / "grpo-s0")
    argv = ["--algos", "grpo,lowlr", "--entry", "lowlr=algo=grpo lr=1e-6", *common]
    assert main(argv) == 0
    assert ledger_rows(runs / "study.jsonl")[:len(first)] == first and step_metrics(runs / "grpo-s0") == grpo_steps
    result = json.loads((out / "results.json").read_text())
    settings = json.loads((runs / "study.jsonl").read_text().splitlines()[0])
    assert {k: settings[k] for k in ("spacing", "k", "final_k", "hard_k", "budgets", "extend", "entries")} == {
        "spacing": "log", "k": 2, "final_k": 4, "hard_k": 3, "budgets": [16, 32], "extend": {"grpo": [64]},
        "entries": {"lowlr": ["algo=grpo", "lr=1e-6"]}}
    rows = {(r["entry"], r["seed"], r["budget"]): r for r in ledger_rows(runs / "study.jsonl")}
    assert set(rows) == {("start", None, 0), ("start_final", None, 0), ("start_hard", None, 0),
                         ("grpo", 0, 16), ("grpo", 0, 32), ("grpo", 0, 64), ("lowlr", 0, 16), ("lowlr", 0, 32)}
    start, final, hard = (rows[name, None, 0] for name in ("start", "start_final", "start_hard"))
    assert [(r["k"], r["sample_seed"]) for r in (start, final, hard)] == [(2, 6), (4, 7), (3, 1005)]
    assert all(len(r["counts"]) == 8 and max(r["counts"].values()) <= r["k"] for r in (start, final, hard))
    expected_hard = [u for u, c in hard["counts"].items() if c == 0]
    assert result["hard_set"] == len(expected_hard)
    for key, row in rows.items():
        if key[1] is None:
            continue
        if key[2] in (32, 64):  # the common budget, and grpo's extended last checkpoint
            assert (row["k"], row["sample_seed"]) == (4, 7)
            assert (row["curve"]["k"], row["curve"]["sample_seed"]) == (2, 6) and "greedy" not in row["curve"]
            assert sum(row["greedy_counts"].values()) / 8 == pytest.approx(row["greedy"])
        else:
            assert (row["k"], row["sample_seed"]) == (2, 6) and "curve" not in row
        brief = next(r for r in result["runs"] if (r["entry"], r["seed"], r["budget"]) == key)
        solved = sum(row["counts"][u] >= 1 for u in expected_hard)
        assert brief["unlocked"] == pytest.approx(solved / len(expected_hard) if expected_hard else 0.0)
        run_dir = runs / f"{key[0]}-s0"
        updates = sum(m.get("optimizer_steps", 0) for m in step_metrics(run_dir)[:row["step"]])
        assert isinstance(row["optimizer_steps"], int) and row["optimizer_steps"] == updates > 0, key
    assert rows["grpo", 0, 64]["rollouts"] >= 64 > rows["grpo", 0, 32]["rollouts"]
    assert result["start_final"]["unlocked"] == pytest.approx(
        sum(final["counts"][u] >= 1 for u in expected_hard) / max(len(expected_hard), 1))
    recorded = json.loads(sqlite3.connect(runs / "lowlr-s0" / "run.db").execute(
        "SELECT json FROM config").fetchone()[0])
    assert (recorded["algo"], recorded["lr"], recorded["steps"]) == ("grpo", 1e-6, 32)
    with pytest.raises(ValueError, match="other settings"):
        main([*argv[:argv.index("--final-k")], "--final-k", "8", *argv[argv.index("--final-k") + 2:]])


def test_a_run_whose_checkpoints_are_gone_trains_again_and_the_report_says_which_rows_came_from_which_run(
        tmp_path, capsys):
    # Could fail if a ledger row did not name its run (its record's created_at), if the study continued without
    # saying that the run it needed was gone, or if the report passed rows of two runs off as one run's curve.
    runs, out = tmp_path / "runs", tmp_path / "out"
    common = ["--algos", "grpo", "--seeds", "0", "--budget", "32", "--checkpoints", "2", "--k", "2", "--final-k", "2",
              "--hard-k", "2", "--limit", "8", "--runs", str(runs), "--out", str(out), *SMALL]
    assert main(common) == 0
    first = read_meta(runs / "grpo-s0")["created_at"]
    assert {r["budget"]: r["run"] for r in ledger_rows(runs / "study.jsonl", drop=()) if r["entry"] == "grpo"} == {
        16: first, 32: first}
    assert "runs of the same settings" not in (out / "results.md").read_text()
    shutil.rmtree(runs / "grpo-s0")  # its checkpoints gone: the extension cannot continue that run
    capsys.readouterr()
    assert main([*common, "--extend", "grpo=2"]) == 0
    assert (f"grpo seed 0: no checkpoint in {runs / 'grpo-s0'} to continue from: a new run trains from the start "
            "policy to 64 (the rows at 16, 32 came from an earlier run)") in capsys.readouterr().err
    second = read_meta(runs / "grpo-s0")["created_at"]
    assert second != first
    assert {r["budget"]: r["run"] for r in ledger_rows(runs / "study.jsonl", drop=()) if r["entry"] == "grpo"} == {
        16: first, 32: first, 64: second}
    # and the code that trained it: this checkout's commit, in the record and in each row
    assert read_meta(runs / "grpo-s0")["commit"] == (commit() or "")
    assert {r["commit"] for r in ledger_rows(runs / "study.jsonl", drop=()) if r["entry"] == "grpo"} == {
        commit() or ""}
    assert "more than one version of the code" not in (out / "results.md").read_text()
    assert ("- grpo seed 0: its rows come from 2 runs of the same settings and seed, each trained from the start "
            "policy (a later one where the earlier one's checkpoints were gone): run 1 at 16, 32; run 2 at 64."
            ) in (out / "results.md").read_text()


def test_rows_of_a_ledger_that_did_not_name_their_run_count_as_one_earlier_run():
    # Could fail if rows without a run (a ledger written before rows named theirs) were left out: the report would
    # then pass an extension's new run and the earlier run's rows off as one curve.
    def row(budget, run=None):
        return {"entry": "grpo", "seed": 0, "budget": budget, **({"run": run} if run else {})}

    old = [row(16), row(32)]
    assert restarted_runs({"runs": old}) == [] and codes_of_runs({"runs": old}) == []
    assert restarted_runs({"runs": [*old, row(64, "2026-11-29T09:46:01")]}) == [
        "- grpo seed 0: its rows come from 2 runs of the same settings and seed, each trained from the start policy "
        "(a later one where the earlier one's checkpoints were gone): run 1 at 16, 32; run 2 at 64. Each row is a "
        "policy trained to its budget; the curve through them is not one run's"]


def test_the_report_says_when_the_runs_rows_came_from_more_than_one_version_of_the_code():
    # Could fail if a ledger row lost its run's commit, or if a study whose rows were trained by two versions of the
    # code (continued after an upgrade, or from a ledger written before rows kept the commit) did not say so.
    def row(budget, code=None):
        return {"entry": "grpo", "seed": 0, "budget": budget, **({"commit": code} if code is not None else {})}

    assert codes_of_runs({"runs": [row(16, "30fe519"), row(32, "30fe519")]}) == []
    assert codes_of_runs({"runs": [row(16), row(32), row(64, "17d1479")]}) == [
        "- the runs were trained by more than one version of the code: commit not recorded at 16, 32; "
        "commit 17d1479 at 64"]
    assert codes_of_runs({"runs": [row(16, "30fe519"), row(16, "17d1479")]}) == [
        "- the runs were trained by more than one version of the code: commit 30fe519 at 16; commit 17d1479 at 16"]


# ----------------------------------------------------------------------------- the report on constructed results

PROMPTS = [f"p{i:02d}" for i in range(40)]


def level(x: float) -> list[int]:
    """Correct counts of the 40 prompts with mean x: floor(x) each, one more for the first ones."""
    extra = round((x - math.floor(x)) * len(PROMPTS))
    return [math.floor(x) + (i < extra) for i in range(len(PROMPTS))]


def constructed(curve: dict[str, list[tuple[int, float]]], seeds=(0, 1, 2), k: int = 4, budget: int = 100,
                extend: dict | None = None):
    """A study result as run_study returns it, built from numbers chosen by hand: `curve[entry]` is (rollouts,
    mean correct count of k) at each of the entry's checkpoints (level()), the same for every seed (or {seed: points}
    for each its own) but that seed s solves prompt 39 - s once more, so seeds differ. The start policy solves every
    prompt 1 of k (greedy: none); its own hard-set samples solve the first 10 prompts 0 times."""
    own = {e: ["algo=grpo"] for e in curve if e not in ("grpo", "bapo", "dapo")}  # entries of one's own
    opts = StudyOptions(algos=list(curve), seeds=list(seeds), budget=budget, checkpoints=2, k=k, extend=extend or {},
                        entries=own)

    def row(entry, seed, budget, rollouts, counts, sample_seed=1):
        greedy = [int(c >= k / 2) for c in counts]
        counts = dict(zip(PROMPTS, counts))
        return {"entry": entry, "seed": seed, "budget": budget, "step": rollouts // 10, "rollouts": rollouts,
                "optimizer_steps": rollouts // 5, "train_seconds": 1.0, "device": "constructed", "k": k,
                "sample_seed": sample_seed, "greedy": sum(greedy) / len(greedy),
                "greedy_counts": dict(zip(PROMPTS, greedy)), "mean@k": sum(counts.values()) / k / len(counts),
                "pass@k": sum(c > 0 for c in counts.values()) / len(counts), "n": len(counts), "counts": counts}

    starts = [row("start", None, 0, 0, [1] * 40), row("start_final", None, 0, 0, [1] * 40),
              row("start_hard", None, 0, 0, [0] * 10 + [1] * 30, sample_seed=1000)]
    hard = hard_set(starts[2]["counts"])
    runs = []
    for entry, by_seed in curve.items():
        for seed in seeds:
            points = by_seed[seed] if isinstance(by_seed, dict) else by_seed
            assert len(points) == len(opts.entry_budgets(entry)), entry
            for b, (rollouts, x) in zip(opts.entry_budgets(entry), points):
                counts = [min(k, c + (i == 39 - seed)) for i, c in enumerate(level(x))]
                runs.append(brief(row(entry, seed, b, rollouts, counts), hard, starts))
    result = {"settings": {"budget": budget, "config": {"task": "countdown", "model": "constructed"}},
              "hard_set": len(hard), **{r["entry"]: brief(r, hard, starts) for r in starts}, "runs": runs}
    return result, opts


def target(stats, words):
    return next(t for t in stats["targets"] if words in t["target"])


def test_targets_are_met_or_not_as_constructed():
    # Could fail if a target's rule or its interval were read wrongly: GRPO gains 0.25 over the start in every seed
    # with greedy higher; BAPO adds 0.0625 (10 of 40 prompts one more of 4) with an interval above 0; BAPO reaches
    # GRPO's final mean@4 at half of GRPO's rollouts; DAPO, trained on to 4x the budget, reaches BAPO's at 4x.
    curve = {"grpo": [(50, 1), (100, 2)], "bapo": [(50, 2), (100, 2.25)],
             "dapo": [(50, 1), (100, 1.5), (200, 2), (400, 2.25)]}
    result, opts = constructed(curve, extend={"dapo": 4})
    stats = analyse(result, opts, resamples=2000)
    assert target(stats, "GRPO raises")["status"] == "met"
    d = stats["versus"]["bapo"]["mean@k"]
    assert d["diff"] == pytest.approx(0.0625) and d["low"] > 0
    assert target(stats, "BAPO - GRPO")["status"] == "met"
    assert f"+0.062 [{d['low']:+.3f}, {d['high']:+.3f}]" in target(stats, "BAPO - GRPO")["detail"]
    ratio = next(r for r in stats["ratios"] if (r["entry"], r["reference"]) == ("bapo", "grpo"))
    assert ratio["ratio"] == pytest.approx(0.5) and ratio["high"] < 1
    assert target(stats, "BAPO reaches GRPO")["status"] == "met"
    slow = next(r for r in stats["ratios"] if (r["entry"], r["reference"]) == ("dapo", "bapo"))
    assert slow["ratio"] == pytest.approx(4.0)
    assert target(stats, "DAPO needs")["status"] == "met"
    text = report(result, opts, {"device": "constructed", "date": "today", "torch": "-", "commit": "-"}, stats)
    assert "## Targets" in text and text.count("**met**") >= 4

    # where nothing holds: GRPO gains 0.025, BAPO = GRPO, DAPO reaches BAPO's final at half its rollouts
    result, opts = constructed({"grpo": [(50, 1), (100, 1.1)], "bapo": [(50, 1), (100, 1.1)],
                                "dapo": [(50, 1.1), (100, 1.1)]})
    stats = analyse(result, opts, resamples=2000)
    assert [target(stats, w)["status"] for w in ("GRPO raises", "BAPO - GRPO", "BAPO reaches GRPO", "DAPO needs")] \
        == ["not met"] * 4
    # DAPO never reaching BAPO within the budget decides nothing about 1.5x; an entry not in the grid is said so
    result, opts = constructed({"grpo": [(50, 1), (100, 2)], "bapo": [(50, 1), (100, 2)],
                                "dapo": [(50, 1), (100, 1.5)]})
    stats = analyse(result, opts, resamples=500)
    assert target(stats, "DAPO needs")["status"] == "not decided"
    assert "--extend dapo=2" in target(stats, "DAPO needs")["detail"]
    result, opts = constructed({"grpo": [(50, 1), (100, 2)], "bapo": [(50, 1), (100, 2)]})
    assert target(analyse(result, opts, resamples=500), "DAPO needs")["status"] == "not in this grid"


def test_gains_by_seed_are_each_runs_own_and_an_extended_entrys_last_checkpoint_has_them_too():
    # Could fail if a seed's gain were taken over other seeds' rows, if its interval drew seeds rather than that
    # run's prompts alone, if an extended entry's last checkpoint were left out, or if the "all" row differed from
    # the gains table.
    curve = {"grpo": {0: [(50, 1), (100, 1.5)], 1: [(50, 1), (100, 2.5)]},
             "dapo": [(50, 1), (100, 1.5), (200, 2), (400, 3)]}
    result, opts = constructed(curve, seeds=(0, 1), extend={"dapo": 4})
    stats = analyse(result, opts, resamples=2000)
    rows = {(g["entry"], g["budget"], g["seed"]): g for g in stats["gain_by_seed"]}
    assert set(rows) == {(e, b, s) for e, budgets in (("grpo", (100,)), ("dapo", (100, 400)))
                         for b in budgets for s in (0, 1, "all")}
    start = result["start_final"]
    for r in [r for r in result["runs"] if r["budget"] in (100, 400)]:
        g = rows[r["entry"], r["budget"], r["seed"]]
        for m in ("mean@k", "greedy"):
            assert g[m]["diff"] == pytest.approx(r[m] - start[m]) and g[m]["n_seeds"] == 1, (r["entry"], m)
            assert g[m]["low"] <= g[m]["diff"] <= g[m]["high"]
    assert rows["grpo", 100, 1]["mean@k"]["diff"] - rows["grpo", 100, 0]["mean@k"]["diff"] == pytest.approx(0.25)
    assert rows["grpo", 100, "all"]["mean@k"] == stats["gain"]["grpo"]["mean@k"]
    assert rows["dapo", 400, "all"]["mean@k"]["diff"] == pytest.approx(2 / 4 + 1 / 4 / 40)
    text = report(result, opts, {"device": "constructed", "date": "today", "torch": "-", "commit": "-"}, stats)
    assert "## Gain over the start policy by seed" in text
    g = rows["dapo", 400, 0]["greedy"]
    assert "| dapo | 400 | 0 | " in text and f"{g['diff']:+.3f} [{g['low']:+.3f}, {g['high']:+.3f}] |" in text


def test_speed_is_not_decided_where_the_start_may_already_reach_the_reference():
    # Could fail if "BAPO reaches GRPO's final with <= 0.75x its rollouts" were judged on the point ratio alone: GRPO
    # ends above the start on average (42.3 of 40 correct) but seed 1 ends below it, so in the resamples drawing
    # seed 1 three times (1 in 27) the start already reaches GRPO's final: the ratio's interval reaches 0x, and
    # BAPO's 0.2x says nothing about speed.
    grpo = {0: [(50, 1), (100, 1.1)], 1: [(50, 1), (100, 0.95)], 2: [(50, 1), (100, 1.05)]}
    result, opts = constructed({"grpo": grpo, "bapo": [(50, 1.1), (100, 1.2)]})
    stats = analyse(result, opts, resamples=2000)
    ratio = next(r for r in stats["ratios"] if (r["entry"], r["reference"]) == ("bapo", "grpo"))
    assert 0 < ratio["ratio"] <= 0.75 and ratio["high"] < 1 and ratio["low"] == 0
    found = target(stats, "BAPO reaches GRPO")
    assert found["status"] == "not decided" and "not told apart from the start policy's" in found["detail"]
    # the same BAPO against a GRPO that ends above the start in every seed: met
    result, opts = constructed({"grpo": [(50, 1), (100, 1.05)], "bapo": [(50, 1.1), (100, 1.2)]})
    assert target(analyse(result, opts, resamples=2000), "BAPO reaches GRPO")["status"] == "met"


def test_gains_by_a_meta_field_are_the_gains_on_each_groups_prompts(tmp_path):
    # Could fail if a group's gain were taken over every prompt (or another group's), if its start figures were not
    # the start's on those prompts, or if the report dropped the table or printed it without --by.
    result, opts = constructed({"grpo": [(50, 1), (100, 2)], "bapo": [(50, 1), (100, 1.5)]})
    groups = {u: "low" if i < 10 else "high" for i, u in enumerate(PROMPTS)}
    opts = dataclasses.replace(opts, by="kind")
    stats = analyse(result, opts, resamples=500, groups=groups)
    by = {g["value"]: g for g in stats["by"]["groups"]}
    assert stats["by"]["field"] == "kind" and {v: g["n"] for v, g in by.items()} == {"high": 30, "low": 10}
    sf = result["start_final"]
    for value, g in by.items():
        members = [u for u in PROMPTS if groups[u] == value]
        assert g["start"]["mean@k"] == pytest.approx(sum(sf["counts"][u] for u in members) / sf["k"] / len(members))
        for entry in ("grpo", "bapo"):
            rows = final_rows(result, entry)
            expected = sum(r["counts"][u] - sf["counts"][u] for r in rows for u in members) / sf["k"] / len(
                members) / len(rows)
            assert g["gain"][entry]["mean@k"]["diff"] == pytest.approx(expected)
    assert by["low"]["gain"]["grpo"]["mean@k"]["diff"] != by["high"]["gain"]["grpo"]["mean@k"]["diff"]
    machine = {"device": "constructed", "date": "today", "torch": "-", "commit": "-"}
    text = report(result, opts, machine, stats)
    assert "## Gain over the start policy by kind" in text and "| low | 10 | " in text and "| high | 30 | " in text
    plain_stats = analyse(result, opts, resamples=500)
    assert "by" not in plain_stats and "by kind" not in report(result, opts, machine, plain_stats)


def test_by_names_the_held_out_problems_meta_field_or_fails_before_training(tmp_path, capsys):
    # Could fail if the groups came from other problems than the evaluations' (splits, limit), or if an unknown field
    # were found out only after the training (or as a traceback instead of one line naming it).
    from bapo_vl.plugins import get_task
    from bapo_vl.study import cli, held_out_groups

    opts = StudyOptions(split="test,val", limit=4, by="kind",
                        overrides=["task=geodraw", "task_options={template: letter}"])
    task = get_task("geodraw", [])
    expected = {p.uid: p.meta["kind"] for split in ("test", "val") for p in task.load(split=split, limit=4)}
    assert held_out_groups(opts) == expected and len(expected) == 8
    runs = tmp_path / "runs"
    assert cli(["--by", "shape", "--budget", "8", "--runs", str(runs), "--out", str(tmp_path / "out"), *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("study: --by shape: no held-out problem of task countdown") and "solution" in err
    assert len(err.splitlines()) == 1 and not runs.exists()


def test_differences_against_the_baseline_are_holm_corrected_over_the_table():
    # Could fail if each comparison kept its own p-value (three entries against grpo: the smallest p triples), if
    # greedy and mean@k were corrected together, or if the report printed the uncorrected p as corrected.
    from bapo_vl.stats import holm

    result, opts = constructed({e: [(50, 1), (100, x)] for e, x in (("grpo", 2), ("a", 2.15), ("b", 2.5),
                                                                    ("c", 1.975))})
    stats = analyse(result, opts, resamples=2000)
    for metric in ("mean@k", "greedy"):
        tests = {e: stats["versus"][e][metric] for e in "abc"}
        expected = holm({e: t["p"] for e, t in tests.items()})
        for e, t in tests.items():
            assert t["family"] == 3 and t["p_holm"] == pytest.approx(expected[e]["p_holm"]) and t["p_holm"] >= t["p"]
            assert t["reject"] == expected[e]["reject"]
        smallest = min(tests.values(), key=lambda t: t["p"])
        assert smallest["p_holm"] == pytest.approx(min(1.0, 3 * smallest["p"]))
    assert stats["versus"]["b"]["mean@k"]["reject"] and not stats["versus"]["c"]["mean@k"]["reject"]
    text = report(result, opts, {"device": "constructed", "date": "today", "torch": "-", "commit": "-"}, stats)
    lines = text.splitlines()
    line = next(x for x in lines[lines.index("## Against grpo: paired differences at the budget"):]
                if x.startswith("| b |"))
    assert f"{stats['versus']['b']['mean@k']['p_holm']:.4f}" in line and "| yes |" in line
    assert "Holm's correction over the 3 comparisons" in text
    # by the start bin: every prompt is at 1/4 at the start (under half), so only that bin has prompts
    assert stats["bins"]["sizes"] == [0, 40, 0, 0]
    assert stats["bins"]["versus"]["b"][1]["diff"] == pytest.approx(stats["versus"]["b"]["mean@k"]["diff"])


def test_report_figures_are_written(tmp_path):
    # Could fail if a figure were not written (the forest plot, the curves against optimizer steps) or if a log
    # axis met the start policy's 0 rollouts.
    pytest.importorskip("matplotlib")
    result, opts = constructed({"grpo": [(50, 1), (100, 2)], "bapo": [(50, 2), (100, 2.25)]})
    stats = analyse(result, opts, resamples=500)
    paths = plot(result, opts, tmp_path, stats)
    assert sorted(p.name for p in paths) == ["accuracy.png", "forest.png", "unlocked.png", "updates.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p


def test_against_the_baseline_at_equal_optimizer_steps_interpolates_in_log_steps():
    # Could fail if the baseline were read at the entry's rollouts instead of its updates, interpolated linearly in
    # steps, or extrapolated past its last checkpoint. GRPO: mean 1/4 after 10 optimizer steps, 2/4 after 20; BAPO
    # reaches 2/4 after 14: GRPO after 14 is 1/4 + 1/4 * ln(1.4) / ln(2), so BAPO leads by 1/4 * (1 - ln 1.4 / ln 2).
    result, opts = constructed({"grpo": [(50, 1), (100, 2)], "bapo": [(50, 1), (100, 2)]})
    for r in result["runs"]:
        if r["entry"] == "bapo" and r["budget"] == 100:
            r["optimizer_steps"] = 14
    d = analyse(result, opts, resamples=500)["at_updates"]["bapo"]
    assert d["diff"] == pytest.approx(0.25 * (1 - math.log(1.4) / math.log(2)))
    assert d["optimizer_steps"] == 14 and d["n_seeds"] == 3
    for r in result["runs"]:
        if r["entry"] == "bapo" and r["budget"] == 100:
            r["optimizer_steps"] = 30  # more updates than GRPO's last checkpoint: no reading, not an extrapolation
    assert analyse(result, opts, resamples=500)["at_updates"]["bapo"] is None
    text = report(result, opts, {"device": "constructed", "date": "today", "torch": "-", "commit": "-"},
                  analyse(result, opts, resamples=500))
    assert "at equal optimizer steps" not in text  # nothing to show
