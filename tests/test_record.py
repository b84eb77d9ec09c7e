"""The run record on a real SQLite file: round trips, live reading under WAL, and the analyses
(hard-problem ledger, accuracy bins, migration matrix) checked against hand-computed answers."""
import json
import math

import pytest
from PIL import Image

from bapo_vl.problem import Problem
from bapo_vl.record import (RunRecord, accuracy_bins, connect_ro, find_runs, hard_problem_ledger, make_sinks,
                            migration_matrix, query_ro, read_run, read_steps)
from bapo_vl.runs_cli import cmd_runs_list, cmd_runs_show

CONFIG = {"algo": "bapo", "G": 4, "batch_size": 8, "buffers": {"c1": 0.125}}

# A small history, G = 4. (uid, correct, G, subset) per step.
HISTORY = {
    1: [("u1", 0, 4, "fresh"), ("u2", 0, 4, "filtered"), ("u3", 2, 4, "fresh"), ("u4", 4, 4, "filtered"),
        ("u8", 1, 4, "fresh"),
        ("u7", 0, 4, "x3")],  # a replay is not a generation: u7 is first *seen* at step 2
    2: [("u3", 2, 4, "x3"), ("u5", 0, 4, "fresh"), ("u7", 0, 4, "fresh"), ("u8", 0, 4, "filtered")],
    3: [("u1", 0, 4, "reeval"),  # re-evaluated, still 0/G: not solved
        ("u2", 3, 4, "x3")],  # replayed old responses claim 3/4: must NOT count as solving u2
    4: [("u2", 2, 4, "x2"), ("u5", 1, 4, "fresh"), ("u1", 0, 4, "reeval"), ("u3", 3, 4, "fresh"),
        ("u4", 4, 4, "x3")],
    5: [("u7", 0, 4, "fresh")],
}


def _record_history(run_dir):
    rec = RunRecord.create(run_dir, CONFIG, name="hist")
    for step, groups in HISTORY.items():
        rec.log_step(step, {"fresh_reward": 0.1 * step, "x2": int(step == 4), "x3": 1, "rollouts": 16},
                     groups=groups)
    rec.close()
    return run_dir


def test_round_trip_meta_config_steps(tmp_path):
    rec = RunRecord.create(tmp_path / "r", CONFIG, name="demo", backend="verl")
    rec.log_step(1, {"x1": 5, "x2": 0, "x3": 2, "batch_size": 8, "loss": 0.25, "fresh_reward": 0.5,
                     "t_generate": 1.5},
                 samples=[("u1", "fresh", 0, "the answer is 4", 1.0, "correct")],
                 verdicts={"correct": 3, "wrong": 4, "unparsable": 1})
    rec.log_step(2, {"x1": 6, "loss": 0.125})
    rec.log_eval(2, "heldout", {"accuracy": 0.75})
    rec.finish()
    rec.close()

    run = read_run(tmp_path / "r")
    assert run["config"] == CONFIG
    meta = run["meta"]
    assert (meta["name"], meta["status"], meta["backend"], meta["schema_version"]) == ("demo", "finished", "verl", "1")
    assert "created_at" in meta and "finished_at" in meta and "bapo_vl_version" in meta
    s1, s2 = run["steps"]
    assert (s1["step"], s1["x1"], s1["x3"], s1["loss"], s1["t_generate"]) == (1, 5, 2, 0.25, 1.5)
    assert (s2["step"], s2["x1"], s2["loss"]) == (2, 6, 0.125)
    assert "x3" not in s2  # not logged -> absent, not invented
    # first-class columns carry the same values as the JSON
    assert [tuple(r) for r in query_ro(tmp_path / "r", "SELECT step, x1, loss FROM steps")] == [(1, 5, 0.25),
                                                                                             (2, 6, 0.125)]
    assert [tuple(r) for r in query_ro(tmp_path / "r", "SELECT verdict, count FROM verdicts ORDER BY verdict")] \
        == [("correct", 3), ("unparsable", 1), ("wrong", 4)]
    assert tuple(query_ro(tmp_path / "r", "SELECT uid, response, reward FROM samples")[0]) == \
        ("u1", "the answer is 4", 1.0)
    assert tuple(query_ro(tmp_path / "r", "SELECT name, metric, value FROM evals")[0]) == ("heldout", "accuracy", 0.75)


def test_unknown_metric_keys_are_kept_and_nan_is_strict_json(tmp_path):
    rec = RunRecord.create(tmp_path / "r", CONFIG)
    rec.log_step(1, {"loss": float("nan"), "my_probe": 3, "per_len": [1, 2], "note": "warmup"})
    rec.close()
    (s,) = read_steps(tmp_path / "r")
    assert (s["my_probe"], s["per_len"], s["note"]) == (3, [1, 2], "warmup")
    assert s["loss"] is None  # NaN stored as null so the JSON stays parseable everywhere
    raw = query_ro(tmp_path / "r", "SELECT metrics FROM steps")[0][0]
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


def test_relogging_a_step_replaces_it(tmp_path):
    # a resumed run may redo steps; nothing may be duplicated
    rec = RunRecord.create(tmp_path / "r", CONFIG)
    rec.log_step(1, {"loss": 1.0}, groups=[("a", 0, 4, "fresh")], verdicts={"wrong": 4})
    rec.log_step(1, {"loss": 2.0}, groups=[("a", 1, 4, "fresh")], verdicts={"wrong": 3, "correct": 1})
    rec.close()
    assert [s["loss"] for s in read_steps(tmp_path / "r")] == [2.0]
    assert accuracy_bins(tmp_path / "r", 1) == [0, 1, 0, 0, 0]
    assert query_ro(tmp_path / "r", "SELECT SUM(count) FROM verdicts")[0][0] == 4


def test_unknown_subset_is_refused(tmp_path):
    rec = RunRecord.create(tmp_path / "r", CONFIG)
    with pytest.raises(ValueError, match="'X2'.*known"):
        rec.log_step(1, {}, groups=[("a", 0, 4, "X2")])
    rec.close()


def test_reader_sees_steps_written_while_writer_stays_open(tmp_path):
    rec = RunRecord.create(tmp_path / "r", CONFIG)
    rec.log_step(1, {"loss": 1.0})
    reader = connect_ro(tmp_path / "r")
    assert reader.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 1
    rec.log_step(2, {"loss": 0.5})  # the writer connection is still open
    assert reader.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 2
    assert [s["step"] for s in read_steps(tmp_path / "r")] == [1, 2]

    # a reader in the middle of a read transaction does not block the writer (WAL); it keeps its snapshot
    reader.execute("BEGIN")
    assert reader.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 2
    rec.log_step(3, {"loss": 0.25})  # would raise "database is locked" in rollback-journal mode
    assert reader.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 2
    reader.execute("COMMIT")
    assert reader.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 3
    with pytest.raises(Exception, match="readonly"):
        reader.execute("DELETE FROM steps")  # readers really are read-only
    reader.close()
    rec.close()


def test_create_refuses_to_overwrite_and_resume_appends(tmp_path):
    rec = RunRecord.create(tmp_path / "r", CONFIG)
    rec.log_step(1, {"loss": 1.0})
    rec.log_step(2, {"loss": 0.9})
    rec.finish("failed")
    rec.close()
    with pytest.raises(FileExistsError, match="resume"):
        RunRecord.create(tmp_path / "r", CONFIG)
    rec = RunRecord.create(tmp_path / "r", CONFIG, resume=True)
    rec.log_step(3, {"loss": 0.8})
    rec.close()
    run = read_run(tmp_path / "r")
    assert [s["step"] for s in run["steps"]] == [1, 2, 3]
    assert run["meta"]["status"] == "running" and "resumed_at" in run["meta"]
    # resuming from a checkpoint at step 1 drops what was logged after it
    RunRecord.open(tmp_path / "r", truncate_after=1).close()
    assert [s["step"] for s in read_steps(tmp_path / "r")] == [1]


def test_open_without_record_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="RunRecord.create"):
        RunRecord.open(tmp_path / "nothing")


def test_context_manager_marks_crash_as_failed(tmp_path):
    with pytest.raises(RuntimeError):
        with RunRecord.create(tmp_path / "r", CONFIG):
            raise RuntimeError("boom")
    assert read_run(tmp_path / "r")["meta"]["status"] == "failed"


def test_problems_stored_once_with_png(tmp_path):
    img = Image.new("RGB", (8, 6), "red")
    p = Problem(uid="g1", messages=[{"role": "user", "content": "angle?"}], answer={"value": 30},
                images=[img], meta={"source": "geo3k"})
    rec = RunRecord.create(tmp_path / "r", CONFIG)
    rec.log_problems([p, Problem(uid="t1", messages=[{"role": "user", "content": "2+2"}], answer="4")])
    rec.log_problems([Problem(uid="g1", messages=[{"role": "user", "content": "changed"}], answer=0)])
    rec.close()
    rows = {r["uid"]: r for r in query_ro(tmp_path / "r", "SELECT * FROM problems")}
    assert set(rows) == {"g1", "t1"}
    assert rows["g1"]["text"] == "angle?"  # first write wins
    assert json.loads(rows["g1"]["answer"]) == {"value": 30} and json.loads(rows["g1"]["meta"])["source"] == "geo3k"
    assert rows["g1"]["image"][:8] == b"\x89PNG\r\n\x1a\n" and rows["t1"]["image"] is None


def test_hard_problem_ledger_hand_computed(tmp_path):
    run = _record_history(tmp_path / "r")
    ledger = hard_problem_ledger(run)
    # first generated 0/4: u1 (step 1), u2 (step 1, filtered), u5 (step 2), u7 (step 2: its x3 row at step 1
    # is no generation). u3, u4, u8 were >= 1/4 at first sight: not in the ledger even though u8 later hit 0.
    # u2 is solved at step 4 by its own X2 generation, not at step 3 by the x3 replay; u5 at step 4 (fresh);
    # u1 stays 0 in re-evaluation; u7 stays 0.
    assert ledger["rows"] == [
        {"uid": "u1", "first_seen": 1, "first_solved": None},
        {"uid": "u2", "first_seen": 1, "first_solved": 4},
        {"uid": "u5", "first_seen": 2, "first_solved": 4},
        {"uid": "u7", "first_seen": 2, "first_solved": None},
    ]
    assert (ledger["first_unsolved"], ledger["later_solved"], ledger["fraction"]) == (4, 2, 0.5)


def test_accuracy_bins_hand_computed(tmp_path):
    run = _record_history(tmp_path / "r")
    # step 1, generated: u1 0, u2 0, u3 2, u4 4, u8 1 (u7 is x3: excluded)
    assert accuracy_bins(run, 1) == [2, 1, 1, 0, 1]
    # step 4: u2 2 (x2), u5 1, u1 0 (reeval), u3 3; u4 is x3: excluded
    assert accuracy_bins(run, 4) == [1, 1, 1, 1, 0]
    assert accuracy_bins(run, 99) == []
    # the stored per-step bins count fresh groups only (kept + filtered), as in SPEC section 5
    assert read_steps(run)[0]["bins"] == [2, 1, 1, 0, 1]
    assert read_steps(run)[2]["bins"] is None  # step 3 generated no fresh groups


def test_migration_matrix_hand_computed(tmp_path):
    run = _record_history(tmp_path / "r")
    m = migration_matrix(run, 1, 4)
    # generated at both steps: u1 0->0, u2 0->2, u3 2->3. (u4 only replayed at 4; u5, u8 at one step only)
    expected = [[0] * 5 for _ in range(5)]
    expected[0][0] = expected[0][2] = expected[2][3] = 1
    assert m == expected
    assert sum(map(sum, m)) == 3
    assert sum(map(sum, migration_matrix(run, 1, 2))) == 1  # u8 (u3 and u7 only replayed at one of them)


def test_summary(tmp_path):
    run = read_run(_record_history(tmp_path / "r"))
    s = run["summary"]
    assert s["n_steps"] == 5 and s["last_step"] == 5 and s["rollouts"] == 80
    assert math.isclose(s["fresh_reward_first"], 0.1) and math.isclose(s["fresh_reward_last"], 0.5)
    assert (s["steps_with_x2"], s["steps_with_x3"]) == (1, 5)
    assert (s["first_unsolved"], s["later_solved"], s["later_solved_fraction"]) == (4, 2, 0.5)


def test_find_runs_newest_first(tmp_path):
    for name in ["a", "b", "sweep/c"]:
        RunRecord.create(tmp_path / name, CONFIG).close()
    rec = RunRecord.open(tmp_path / "a")  # touching an old run must not make it "newest"
    rec.log_step(1, {})
    rec.close()
    (tmp_path / "not_a_run").mkdir()
    assert find_runs(tmp_path) == [tmp_path / "sweep/c", tmp_path / "b", tmp_path / "a"]
    assert find_runs(tmp_path / "empty") == []


def test_runs_show_json_has_documented_keys(tmp_path, capsys):
    _record_history(tmp_path / "runs" / "hist")
    assert cmd_runs_show("hist", root=str(tmp_path / "runs"), as_json=True) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"run_dir", "meta", "config", "steps", "summary"}
    assert set(out["summary"]) == {"n_steps", "last_step", "rollouts", "fresh_reward_first", "fresh_reward_last",
                                   "steps_with_x2", "steps_with_x3", "first_unsolved", "later_solved",
                                   "later_solved_fraction"}
    assert out["config"] == CONFIG and [s["step"] for s in out["steps"]] == [1, 2, 3, 4, 5]
    # also by directory path, and as a table
    assert cmd_runs_show(str(tmp_path / "runs" / "hist"), as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["meta"]["name"] == "hist"
    assert cmd_runs_show("hist", root=str(tmp_path / "runs")) == 0
    assert "hist" in capsys.readouterr().out


def test_runs_show_unknown_run_and_list(tmp_path, capsys):
    assert cmd_runs_show("nope", root=str(tmp_path)) == 2
    assert "nope" in capsys.readouterr().err
    _record_history(tmp_path / "runs" / "hist")
    assert cmd_runs_list(str(tmp_path / "runs")) == 0
    out = capsys.readouterr().out
    assert "hist" in out and "running" in out
    assert cmd_runs_list(str(tmp_path / "missing")) == 0


def test_tensorboard_sink_writes_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    rec = RunRecord.create(run_dir, CONFIG, sinks=make_sinks(["tensorboard"], run_dir, CONFIG))
    rec.log_step(1, {"loss": 0.5, "note": "text is not a scalar", "bins": [1, 2]})
    rec.log_step(2, {"loss": 0.25})
    rec.log_eval(2, "heldout", {"accuracy": 0.75})
    rec.close()
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert [e.value for e in acc.Scalars("eval/heldout/accuracy")] == [0.75]
    assert "note" not in acc.Tags()["scalars"]


def test_make_sinks_unknown_kind_lists_known(tmp_path):
    with pytest.raises(ValueError, match="tensorboard"):
        make_sinks(["mlflow"], tmp_path, CONFIG)


def test_verifier_version_history_across_resumes(tmp_path):
    # Could fail if a resume with a changed verifier overwrote which verifier judged the earlier steps, or if
    # steps dropped by the resume (truncate_after) kept a version entry.
    rec = RunRecord.create(tmp_path / "r", CONFIG)
    rec.set_verifier("math-1.0", 1)
    rec.close()
    rec = RunRecord.open(tmp_path / "r", truncate_after=10)
    rec.set_verifier("math-1.0", 11)  # same verifier: nothing new
    rec.set_verifier("math-1.1", 21)
    rec.close()
    meta = read_run(tmp_path / "r")["meta"]
    assert meta["verifier_version"] == "math-1.1"
    assert json.loads(meta["verifier_versions"]) == [["math-1.0", 1], ["math-1.1", 21]]
    rec = RunRecord.open(tmp_path / "r", truncate_after=15)
    rec.set_verifier("math-1.2", 16)  # steps 16.. are trained again: math-1.1 judged none of the kept steps
    rec.close()
    assert json.loads(read_run(tmp_path / "r")["meta"]["verifier_versions"]) == [["math-1.0", 1], ["math-1.2", 16]]
