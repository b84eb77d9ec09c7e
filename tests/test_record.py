"""The run record on a real SQLite file: round trips, live reading under WAL, the upgrade of an old record, and
the reader's analyses (hard-problem ledger, accuracy bins, migration matrix, summary) checked against
hand-computed answers. tests/test_dashboard.py checks the same reader on real runs against SQL and plain loops."""
import json
import math
import sqlite3

import pytest
from PIL import Image

from bapo_vl import record as R
from bapo_vl.cli import main
from bapo_vl.problem import Problem
from bapo_vl.provenance import commit
from bapo_vl.reader import Run, read_run
from bapo_vl.record import FILTERED, NOT_PROMOTED, X1, X2, X3, RunRecord, connect_ro, find_runs, make_sinks, query_ro
from bapo_vl.runs_cli import cmd_runs_list, cmd_runs_show, cmd_runs_upgrade

CONFIG = {"algo": "bapo", "G": 4, "batch_size": 8, "buffers": {"c1": 0.125}}

# A small history, G = 4. (uid, correct, G, subset) per step.
HISTORY = {
    1: [("u1", 0, 4, X1), ("u2", 0, 4, FILTERED), ("u3", 2, 4, X1), ("u4", 4, 4, FILTERED),
        ("u8", 1, 4, X1),
        ("u7", 0, 4, X3)],  # a replay is not a generation: u7 is first *seen* at step 2
    2: [("u3", 2, 4, X3), ("u5", 0, 4, X1), ("u7", 0, 4, X1), ("u8", 0, 4, FILTERED)],
    3: [("u1", 0, 4, NOT_PROMOTED),  # re-evaluated, still 0/G: not solved
        ("u2", 3, 4, X3)],  # replayed old responses claim 3/4: must NOT count as solving u2
    4: [("u2", 2, 4, X2), ("u5", 1, 4, X1), ("u1", 0, 4, NOT_PROMOTED), ("u3", 3, 4, X1),
        ("u4", 4, 4, X3)],
    5: [("u7", 0, 4, X1)],
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
                 samples=[("u1", X1, 0, "the answer is 4", 1.0, "correct")],
                 verdicts={"correct": 3, "wrong": 4, "unparsable": 1})
    rec.log_step(2, {"x1": 6, "loss": 0.125})
    rec.log_eval(2, "heldout", {"accuracy": 0.75})
    rec.finish()
    rec.close()

    run = read_run(tmp_path / "r")
    assert run["config"] == CONFIG
    meta = run["meta"]
    assert (meta["name"], meta["status"], meta["backend"], meta["schema_version"]) == ("demo", "finished", "verl", str(R.SCHEMA_VERSION))
    assert "created_at" in meta and "finished_at" in meta and "bapo_vl_version" in meta
    assert meta["commit"] == (commit() or "")  # which code made the run: this checkout's commit
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
    (s,) = Run(tmp_path / "r").step_records()
    assert (s["my_probe"], s["per_len"], s["note"]) == (3, [1, 2], "warmup")
    assert s["loss"] is None  # NaN stored as null so the JSON stays parseable everywhere
    raw = query_ro(tmp_path / "r", "SELECT metrics FROM steps")[0][0]
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


def test_relogging_a_step_replaces_it(tmp_path):
    # a resumed run may redo steps; nothing may be duplicated
    rec = RunRecord.create(tmp_path / "r", CONFIG)
    rec.log_step(1, {"loss": 1.0}, groups=[("a", 0, 4, X1)], verdicts={"wrong": 4})
    rec.log_step(1, {"loss": 2.0}, groups=[("a", 1, 4, X1)], verdicts={"wrong": 3, "correct": 1})
    rec.close()
    run = Run(tmp_path / "r")
    assert [s["loss"] for s in run.step_records()] == [2.0]
    assert run.accuracy_bins(1) == [0, 1, 0, 0, 0]
    assert query_ro(tmp_path / "r", "SELECT SUM(count) FROM verdicts")[0][0] == 4


def test_unknown_subset_is_refused(tmp_path):
    rec = RunRecord.create(tmp_path / "r", CONFIG)
    with pytest.raises(ValueError, match="'X2'.*known"):
        rec.log_step(1, {}, groups=[("a", 0, 4, "X2")])
    with pytest.raises(ValueError, match="'fresh'.*known"):  # the version 1 name, in a sample
        rec.log_step(1, {}, samples=[("a", "fresh", 0, "4", 1.0, "correct")])
    rec.close()


def test_reader_sees_steps_written_while_writer_stays_open(tmp_path):
    rec = RunRecord.create(tmp_path / "r", CONFIG)
    rec.log_step(1, {"loss": 1.0})
    reader = connect_ro(tmp_path / "r")
    assert reader.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 1
    rec.log_step(2, {"loss": 0.5})  # the writer connection is still open
    assert reader.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 2
    assert [s["step"] for s in Run(tmp_path / "r").step_records()] == [1, 2]

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
    assert [s["step"] for s in Run(tmp_path / "r").step_records()] == [1]


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
    ledger = Run(_record_history(tmp_path / "r")).ledger()
    # first generated 0/4: u1 (step 1), u2 (step 1, filtered), u5 (step 2), u7 (step 2: its x3 row at step 1
    # is no generation). u3, u4, u8 were >= 1/4 at first sight: not in the ledger even though u8 later hit 0.
    # u2 is solved at step 4 by its own X2 generation, not at step 3 by the x3 replay; u5 at step 4 (fresh);
    # u1 stays 0 in re-evaluation; u7 stays 0.
    assert ledger.astype(object).where(ledger.notna(), None).to_dict("records") == [
        {"uid": "u1", "first_seen": 1, "first_solved": None},
        {"uid": "u2", "first_seen": 1, "first_solved": 4},
        {"uid": "u5", "first_seen": 2, "first_solved": 4},
        {"uid": "u7", "first_seen": 2, "first_solved": None},
    ]


def test_accuracy_bins_hand_computed(tmp_path):
    run = Run(_record_history(tmp_path / "r"))
    # step 1, generated: u1 0, u2 0, u3 2, u4 4, u8 1 (u7 is x3: excluded)
    assert run.accuracy_bins(1) == [2, 1, 1, 0, 1]
    # step 4: u2 2 (x2), u5 1, u1 0 (not promoted), u3 3; u4 is x3: excluded
    assert run.accuracy_bins(4) == [1, 1, 1, 1, 0]
    assert run.accuracy_bins(99) == [0] * 5
    # the stored per-step bins count fresh groups only (kept + filtered), as in SPEC section 5
    assert run.step_records()[0]["bins"] == [2, 1, 1, 0, 1]
    assert run.step_records()[2]["bins"] is None  # step 3 generated no fresh groups


def test_migration_matrix_hand_computed(tmp_path):
    run = Run(_record_history(tmp_path / "r"))
    hist_a, hist_b, m = run.migration(1, 4)
    # generated at both steps: u1 0->0, u2 0->2, u3 2->3. (u4 only replayed at 4; u5, u8 at one step only)
    expected = [[0] * 5 for _ in range(5)]
    expected[0][0] = expected[0][2] = expected[2][3] = 1
    assert m == expected
    assert (hist_a, hist_b) == (run.accuracy_bins(1), run.accuracy_bins(4))
    assert sum(map(sum, run.migration(1, 2)[2])) == 1  # u8 (u3 and u7 only replayed at one of them)


def test_migration_windows_hand_computed(tmp_path):
    run = Run(_record_history(tmp_path / "r"))
    hist_a, hist_b, m = run.migration(2, 4, window=True)
    # latest generated result up to step 2: u1 0, u2 0, u3 2, u4 4, u5 0, u7 0, u8 0 (step 2 overrides its 1)
    assert hist_a == [5, 0, 1, 0, 1]
    # up to step 4: u1 0 (step 4), u2 2 (x2 at 4, not the x3 replay at 3), u3 3, u4 4, u5 1, u7 0, u8 0
    assert hist_b == [3, 1, 1, 1, 1]
    # generated up to 2 and again in (2, 4]: u1 0->0, u2 0->2, u3 2->3, u5 0->1
    expected = [[0] * 5 for _ in range(5)]
    expected[0][0] = expected[0][2] = expected[2][3] = expected[0][1] = 1
    assert m == expected


def test_a_prompt_generated_twice_at_one_step_counts_once_by_its_fresh_group(tmp_path):
    rec = RunRecord.create(tmp_path / "r", CONFIG)
    rec.log_step(1, {}, groups=[("a", 3, 4, X1), ("a", 0, 4, NOT_PROMOTED), ("b", 0, 4, X2), ("b", 1, 4, FILTERED)])
    rec.log_step(2, {}, groups=[("a", 1, 4, X2), ("b", 2, 4, X1)])
    rec.close()
    run = Run(tmp_path / "r")
    assert run.accuracy_bins(1) == [0, 1, 0, 1, 0]  # a by its 3/4, b by its 1/4
    assert run.migration(1, 2)[2][3][1] == 1 and run.migration(1, 2)[2][1][2] == 1
    assert run.ledger().empty  # a was 3/4 and b 1/4 at their first step: neither was 0/G on every group


def test_summary(tmp_path):
    run = read_run(_record_history(tmp_path / "r"))
    s = run["summary"]
    assert s == Run(tmp_path / "r").summary()
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
    out = capsys.readouterr().out  # recorded as running, but no trainer holds the directory: it was killed
    assert "hist" in out and "stopped (killed?)" in out and str(tmp_path / "runs" / "hist") in out
    held = R.lock_run_dir(tmp_path / "runs" / "hist")  # a live trainer
    try:
        assert R.trainer_alive(tmp_path / "runs" / "hist")
        assert cmd_runs_list(str(tmp_path / "runs")) == 0
        out = capsys.readouterr().out
        assert "running" in out and "stopped" not in out
    finally:
        held.close()
    assert not R.trainer_alive(tmp_path / "runs" / "hist")
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


# ----------------------------------------------------------------------------- version 1 and 2 records

V1_NAMES = {X1: "fresh", NOT_PROMOTED: "reeval"}  # what version 1 called them; the other subsets kept their names
# the steps table's own columns as version 2 wrote them (version 1: the same but pg_loss and grad_norm), written out
# here rather than derived from today's schema; the other tables have not changed since version 1
V2_STEP_COLUMNS = ("x1 INTEGER", "x2 INTEGER", "x3 INTEGER", "batch_size INTEGER", "bad_size INTEGER",
                   "high_size INTEGER", "c2 REAL", "c3 REAL", "r_tot REAL", "rollouts INTEGER", "fresh_reward REAL",
                   "reward REAL", "loss REAL", "pg_loss REAL", "kl REAL", "entropy REAL", "clip_frac REAL",
                   "grad_norm REAL", "t_generate REAL", "t_score REAL", "t_train REAL", "t_sync REAL")


def _old_tables(conn, version):
    columns = [c for c in V2_STEP_COLUMNS if version > 1 or c.split()[0] not in ("pg_loss", "grad_norm")]
    conn.execute(f"CREATE TABLE steps (step INTEGER PRIMARY KEY, time REAL, metrics TEXT, bins TEXT, "
                 f"{', '.join(columns)})")
    conn.executescript(R.SCHEMA)  # every other table (steps exists already: IF NOT EXISTS leaves it)


def _old_record(run_dir, version: int, name: str, created_at: str):
    """A record of schema `version` opened by hand: its tables, meta and config, no steps yet."""
    run_dir.mkdir(parents=True)
    conn = sqlite3.connect(run_dir / R.DB_NAME)
    conn.execute("PRAGMA journal_mode=WAL")
    _old_tables(conn, version)
    conn.executemany("INSERT INTO meta VALUES (?, ?)", [("schema_version", str(version)), ("name", name),
                                                       ("status", "finished"), ("created_at", created_at)])
    conn.execute("INSERT INTO config VALUES (?)", (json.dumps(CONFIG),))
    return conn


def _v1_record(run_dir):
    """A version 1 record written by hand, as bapo-vl wrote them before the subset vocabulary changed: HISTORY with
    the old subset names, the old metric keys, and samples named `fresh` for kept and filtered groups alike."""
    conn = _old_record(run_dir, 1, "old", "2025-01-01T00:00:00")
    for step, groups in HISTORY.items():
        metrics = {"x2": int(step == 4), "rollouts": 16, "rollouts_fresh": 8, "rollouts_reeval": 8,
                   "reeval_reward": 1 / 3, "fresh_reward": 0.1 * step, "per_len": [1, 2], "pg_loss": 0.5 * step,
                   "grad_norm": 2.0, "t_score": 0.25}
        conn.execute("INSERT INTO steps (step, time, metrics, bins, x2, rollouts, fresh_reward, t_score) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                     (step, float(step), json.dumps(metrics), "null", metrics["x2"], 16, 0.1 * step, 0.25))
        conn.executemany("INSERT INTO prompt_steps VALUES (?, ?, ?, ?, ?)",
                         [(step, u, c, g, V1_NAMES.get(s, s)) for u, c, g, s in groups])
    # u3 was kept and u2 filtered at step 1, both sampled as `fresh`; u9 has a sample but no group row
    conn.executemany("INSERT INTO samples VALUES (?, ?, ?, ?, ?, ?, ?)",
                     [(1, "u3", "fresh", 0, "r", 1.0, "correct"), (1, "u2", "fresh", 0, "r", 0.0, "wrong"),
                      (4, "u2", "x2", 0, "r", 1.0, "correct"), (4, "u9", "fresh", 0, "r", 0.0, "wrong")])
    conn.commit()
    conn.close()
    return run_dir


def test_readers_refuse_a_v1_record_and_say_how_to_upgrade(tmp_path, capsys):
    run_dir = _v1_record(tmp_path / "runs" / "old")
    for read in (read_run, Run, lambda d: query_ro(d, "SELECT * FROM steps")):
        with pytest.raises(R.RecordVersionError, match=r"run\.db is a run record of schema version 1.*"
                                                       r"bapo runs upgrade .*old"):
            read(run_dir)
    with pytest.raises(R.RecordVersionError):
        cmd_runs_show(str(run_dir))
    assert main(["runs", "show", str(run_dir)]) == 2  # bapo's main prints the message
    assert f"bapo runs upgrade {run_dir}" in capsys.readouterr().err
    assert cmd_runs_list(str(tmp_path / "runs")) == 0  # still listed, with what to do
    assert "bapo runs upgrade" in capsys.readouterr().out.replace("\n", " ").replace("│", " ")


def test_upgrade_rewrites_a_v1_record_in_place(tmp_path, capsys):
    run_dir = _v1_record(tmp_path / "runs" / "old")
    assert cmd_runs_upgrade("old", root=str(tmp_path / "runs")) == 0
    assert f"from schema version 1 to {R.SCHEMA_VERSION}" in capsys.readouterr().out
    new = Run(_record_history(tmp_path / "new"))  # the same history written with today's names
    rows = lambda d: sorted(tuple(r) for r in query_ro(d, "SELECT step, uid, correct, G, subset FROM prompt_steps"))
    assert rows(run_dir) == rows(tmp_path / "new")
    samples = [tuple(r) for r in query_ro(run_dir, "SELECT step, uid, subset FROM samples ORDER BY rowid")]
    assert samples == [(1, "u3", X1), (1, "u2", FILTERED), (4, "u2", X2), (4, "u9", X1)]
    run = Run(run_dir)
    for s in run.step_records():
        assert "rollouts_reeval" not in s and "reeval_reward" not in s
        assert s["rollouts_reevaluated"] == 8 and s["reevaluated_reward"] == 1 / 3  # exactly: no float rounding
        assert s["rollouts_fresh"] == 8 and s["per_len"] == [1, 2]  # the rest untouched
        assert "t_score" not in s and s["t_verify"] == 0.25  # and on through version 2
    assert run.steps()["rollouts_reevaluated"].tolist() == [8] * 5
    assert [r[0] for r in query_ro(run_dir, "SELECT t_verify FROM steps")] == [0.25] * 5
    assert run.steps()["pg_loss"].tolist() == [0.5 * t for t in HISTORY]  # v1 kept it in the JSON only
    assert run.steps()["grad_norm"].tolist() == [2.0] * 5
    meta = run.meta()
    assert meta["schema_version"] == str(R.SCHEMA_VERSION) and "upgraded_at" in meta
    assert run.ledger().equals(new.ledger())
    assert [run.accuracy_bins(t) for t in HISTORY] == [new.accuracy_bins(t) for t in HISTORY]
    # a second upgrade has nothing to do
    assert not R.upgrade(run_dir)
    assert cmd_runs_upgrade(str(run_dir)) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_upgrade_is_one_transaction(tmp_path, monkeypatch):
    run_dir = _v1_record(tmp_path / "old")
    before = [tuple(r) for r in sqlite3.connect(run_dir / R.DB_NAME).execute("SELECT * FROM prompt_steps")]

    def fail():  # _now is called last, for meta upgraded_at: everything else was already rewritten
        raise RuntimeError("disk full")

    monkeypatch.setattr(R, "_now", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        R.upgrade(run_dir)
    conn = sqlite3.connect(run_dir / R.DB_NAME)
    assert [tuple(r) for r in conn.execute("SELECT * FROM prompt_steps")] == before
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "1"
    assert conn.execute("SELECT COUNT(*) FROM steps WHERE metrics LIKE '%rollouts_reeval\"%'").fetchone()[0] == 5
    conn.close()


def test_the_writer_upgrades_a_v1_record_it_opens(tmp_path):
    run_dir = _v1_record(tmp_path / "old")
    rec = RunRecord.open(run_dir)  # e.g. a resumed run, or `bapo eval --run`
    rec.log_step(6, {"rollouts_reevaluated": 0}, groups=[("u1", 2, 4, X1)])
    rec.close()
    run = Run(run_dir)
    assert [s["step"] for s in run.step_records()] == [1, 2, 3, 4, 5, 6]
    assert Run(run_dir).ledger().set_index("uid").loc["u1", "first_solved"] == 6


def _v2_timings(step):
    """A version 2 step's seconds: the verifier's as t_score; generate's split logged in the metrics JSON only, and
    at step 5 without t_generate_logprobs (as verl logged it)."""
    t = {"t_generate": 1.5 * step, "t_generate_sample": 1.0 * step, "t_score": 0.125 * step, "t_train": 2.0,
         "t_sync": 0.5 if step % 2 else 0.0}
    if step != 5:
        t["t_generate_logprobs"] = 0.25 * step
    return t


def _v2_record(run_dir):
    """A version 2 record written by hand with version 2's steps table: HISTORY, and _v2_timings per step."""
    conn = _old_record(run_dir, 2, "two", "2025-06-01T00:00:00")
    cols = ("x2", "x3", "rollouts", "fresh_reward", "t_generate", "t_score", "t_train", "t_sync")
    for step, groups in HISTORY.items():
        metrics = {"x2": int(step == 4), "x3": 1, "rollouts": 16, "fresh_reward": 0.1 * step, **_v2_timings(step)}
        conn.execute(f"INSERT INTO steps (step, time, metrics, bins, {', '.join(cols)}) VALUES "
                     f"({', '.join('?' * (4 + len(cols)))})",
                     (step, 100.0 + step, json.dumps(metrics), "null", *(metrics[c] for c in cols)))
        conn.executemany("INSERT INTO prompt_steps VALUES (?, ?, ?, ?, ?)", [(step, *g) for g in groups])
    conn.commit()
    conn.close()
    return run_dir


def _check_v2_steps(steps):
    """A v2 record's steps (read_run's) under today's names, with the values it recorded."""
    assert [s["step"] for s in steps] == list(HISTORY)
    for s in steps:
        t = _v2_timings(s["step"])
        assert "t_score" not in s and s["t_verify"] == t["t_score"]
        assert {k: s.get(k) for k in ("t_generate", "t_generate_sample", "t_generate_logprobs", "t_train", "t_sync")} \
            == {k: t.get(k) for k in ("t_generate", "t_generate_sample", "t_generate_logprobs", "t_train", "t_sync")}


def test_readers_read_a_v2_record_as_it_is_and_write_nothing(tmp_path, capsys):
    # Could fail if the readers refused a v2 record (one on a read-only disk could then not be read at all), showed
    # its verifier time under the old name, or wrote to the record while reading it.
    from bapo_vl.app import views

    run_dir = _v2_record(tmp_path / "runs" / "two")
    before = (run_dir / R.DB_NAME).read_bytes()
    steps = read_run(run_dir)["steps"]
    _check_v2_steps(steps)
    run = Run(run_dir)
    assert run.steps()["t_verify"].tolist() == [_v2_timings(t)["t_score"] for t in HISTORY]
    assert "t_score" not in run.metrics() and run.metrics()["t_verify"].tolist() == run.steps()["t_verify"].tolist()
    assert run.ledger().equals(Run(_record_history(tmp_path / "new")).ledger())
    # the dashboard's wall time per step stacks the verifier's seconds under its label
    bars = views.time_spec(run.steps())["layer"][0]["data"]["values"]
    assert [b["value"] for b in bars if b["series"] == views.PHASES["t_verify"]] == \
        [_v2_timings(t)["t_score"] for t in HISTORY]
    seconds = sum(_v2_timings(t)[k] for t in HISTORY for k in ("t_generate", "t_score", "t_train", "t_sync"))
    assert f"wall time recorded: {seconds / 60:.1f} min" in views.overview_text("two", run.meta(), run.config(),
                                                                                run.steps(), run.evals())
    assert cmd_runs_show(str(run_dir), as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == steps
    assert cmd_runs_show(str(run_dir)) == 0
    assert "verify s" in capsys.readouterr().out
    assert cmd_runs_list(str(tmp_path / "runs")) == 0
    out = capsys.readouterr().out
    assert "two" in out and "upgrade" not in out
    assert (run_dir / R.DB_NAME).read_bytes() == before and not R.wal_files(run_dir)[0].exists()
    assert R.read_meta(run_dir)["schema_version"] == "2"


def test_upgrade_rewrites_a_v2_record_in_place(tmp_path, capsys):
    run_dir = _v2_record(tmp_path / "runs" / "two")
    as_it_was = read_run(run_dir)["steps"]
    assert cmd_runs_upgrade("two", root=str(tmp_path / "runs")) == 0
    assert f"from schema version 2 to {R.SCHEMA_VERSION}" in capsys.readouterr().out
    columns = [r[1] for r in sqlite3.connect(run_dir / R.DB_NAME).execute("PRAGMA table_info(steps)")]
    assert "t_score" not in columns and {"t_verify", "t_generate_sample", "t_generate_logprobs"} <= set(columns)
    # the columns carry what the JSON does (generate's split was in the JSON only), NULL where nothing was logged
    rows = [tuple(r) for r in query_ro(run_dir, "SELECT step, t_generate, t_generate_sample, t_generate_logprobs, "
                                                "t_verify, t_train, t_sync FROM steps ORDER BY step")]
    assert rows == [(t, *(_v2_timings(t).get(k) for k in ("t_generate", "t_generate_sample", "t_generate_logprobs",
                                                          "t_score", "t_train", "t_sync"))) for t in HISTORY]
    assert query_ro(run_dir, "SELECT COUNT(*) FROM steps WHERE metrics LIKE '%t_score%'")[0][0] == 0
    steps = read_run(run_dir)["steps"]
    _check_v2_steps(steps)
    assert steps == as_it_was  # the upgrade changes names, never what the readers show
    assert R.read_meta(run_dir)["schema_version"] == str(R.SCHEMA_VERSION)
    # the writer appends to it as to any record of this version
    rec = RunRecord.open(run_dir)
    rec.log_step(6, {"t_verify": 0.5, "t_generate_sample": 1.0}, groups=[("u1", 2, 4, X1)])
    rec.close()
    assert tuple(query_ro(run_dir, "SELECT t_verify, t_generate_sample FROM steps WHERE step = 6")[0]) == (0.5, 1.0)
    assert not R.upgrade(run_dir)


def test_the_writer_upgrades_a_v2_record_it_opens(tmp_path):
    run_dir = _v2_record(tmp_path / "two")
    RunRecord.open(run_dir, resume=False).close()  # e.g. `bapo eval --run`
    assert R.read_meta(run_dir)["schema_version"] == str(R.SCHEMA_VERSION)
    _check_v2_steps(read_run(run_dir)["steps"])


def test_upgrade_waits_for_a_trainer_writing_the_record(tmp_path, capsys):
    # Could fail if `bapo runs upgrade` renamed the columns under an older bapo-vl's trainer, whose next step would
    # then fail to write.
    run_dir = _v2_record(tmp_path / "runs" / "two")
    held = R.lock_run_dir(run_dir)
    try:
        with pytest.raises(R.RunLockedError, match="being written by a trainer"):
            cmd_runs_upgrade(str(run_dir))
        assert main(["runs", "upgrade", str(run_dir)]) == 2
        assert "being written by a trainer" in capsys.readouterr().err
        assert R.read_meta(run_dir)["schema_version"] == "2"
    finally:
        held.close()
    assert cmd_runs_upgrade(str(run_dir)) == 0
    assert R.read_meta(run_dir)["schema_version"] == str(R.SCHEMA_VERSION)


def test_a_newer_record_is_refused(tmp_path):
    rec = RunRecord.create(tmp_path / "r", CONFIG)
    rec.conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(R.SCHEMA_VERSION + 1),))
    rec.conn.commit()
    rec.close()
    for fn in (R.upgrade, RunRecord.open, Run):
        with pytest.raises(R.RecordVersionError, match="newer than this bapo-vl"):
            fn(tmp_path / "r")
