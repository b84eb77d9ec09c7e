"""Reading a run never writes to it : no -wal/-shm files, no changed byte; a run on a read-only
disk is read (cleanly finished or killed); damaged records are reported per run while the others are still
listed; `bapo eval --run` on a read-only record refuses before it computes anything.

"Read-only" is real here: for a normal user the folder's write bits are cleared; root ignores those, so for root
the folder is covered by a read-only bind mount of itself (needs CAP_SYS_ADMIN; skipped, saying so, without it).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from bapo_vl.cli import main
from bapo_vl.reader import Run
from bapo_vl.record import X1, RunRecord, UnreadableRecordError, connect_ro, find_runs, read_meta, wal_files

GROUPS = [("u1", 0, 4, X1), ("u2", 3, 4, X1)]


def finished_run(run_dir: Path, name: str | None = None, steps: int = 3) -> Path:
    rec = RunRecord.create(run_dir, {"group_size": 4, "steps": steps}, name=name)
    for t in range(1, steps + 1):
        rec.log_step(t, {"fresh_reward": 0.25 * t, "x1": 2}, groups=GROUPS)
    rec.finish()
    rec.close()
    return run_dir


WRITER = """
import sys, time
from bapo_vl.record import RunRecord
rec = RunRecord.create(sys.argv[1], {"group_size": 4, "steps": 5}, name="killed")
rec.log_step(1, {"fresh_reward": 0.5, "x1": 2}, groups=[("u1", 1, 4, "x1")])
print("logged", flush=True)
time.sleep(600)
"""


def killed_run(run_dir: Path) -> Path:
    """A run whose writer was SIGKILLed after a step: its record says running, its step is in run.db-wal."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "logged"
    finally:
        proc.kill()  # the writer this test started, by its own handle
        proc.wait()
    assert all(p.exists() for p in wal_files(run_dir))
    return run_dir


def state(folder: Path) -> dict:
    """Every file under folder with its size, mtime and content hash."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


@contextmanager
def read_only(folder: Path):
    """`folder` read-only for this process, really (see the module doc); checked by trying to write."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [folder, *folder.rglob("*")]}
        for p, mode in modes.items():
            p.chmod(mode & ~0o222)
        undo = lambda: [p.chmod(mode) for p, mode in modes.items()]  # noqa: E731
    else:
        for args in (["mount", "--bind", str(folder), str(folder)], ["mount", "-o", "remount,bind,ro", str(folder)]):
            try:
                done = subprocess.run(args, capture_output=True, text=True)
            except FileNotFoundError:
                pytest.skip("running as root, and there is no `mount` to make a folder read-only for root")
            if done.returncode:
                subprocess.run(["umount", str(folder)], capture_output=True)
                pytest.skip(f"running as root, and root cannot mount a read-only folder here: {done.stderr.strip()}")
        undo = lambda: subprocess.run(["umount", str(folder)], check=True)  # noqa: E731
    try:
        with pytest.raises(OSError):
            (folder / "probe").write_text("x")
        assert not os.access(folder, os.W_OK)
        yield folder
    finally:
        undo()


def test_reading_a_finished_run_writes_nothing(tmp_path, capsys):
    # Could fail if a reader opened the WAL record with mode=ro (SQLite then creates run.db-wal and run.db-shm
    # and leaves them), or migrated or touched it.
    run = finished_run(tmp_path / "runs" / "a")
    before = state(tmp_path)
    assert list(before) == ["runs/a/run.db"]
    assert main(["runs", "--root", str(tmp_path / "runs")]) == 0
    assert main(["runs", "show", str(run)]) == 0
    assert main(["runs", "show", str(run), "--json"]) == 0
    r = Run(run)
    assert len(r.steps()) == 3 and len(r.ledger()) == 1 and r.accuracy_bins(2) == [1, 0, 0, 1, 0]
    assert read_meta(run)["status"] == "finished" and find_runs(tmp_path) == [run]
    capsys.readouterr()
    assert state(tmp_path) == before


def test_runs_on_a_read_only_disk_are_read(tmp_path, capsys):
    # Could fail if a cleanly finished WAL record needed its -shm file (mode=ro on a read-only folder), if a killed
    # run's steps in its WAL were missed, or if one unreadable run stopped the listing.
    root = tmp_path / "runs"
    finished = finished_run(root / "finished")
    killed = killed_run(root / "killed")
    before = state(tmp_path)
    with read_only(tmp_path):
        assert main(["runs", "--root", str(root)]) == 0
        out = capsys.readouterr().out
        assert "finished" in out and str(finished) in out
        assert "stopped (killed?)" in out and str(killed) in out
        assert main(["runs", "show", str(killed), "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["meta"]["status"] == "running" and [s["step"] for s in shown["steps"]] == [1]  # from the WAL
        assert main(["runs", "show", str(killed)]) == 0
        assert "killed  [stopped (killed?)]" in capsys.readouterr().out
        assert Run(killed).status() == "stopped (killed?)"  # what the dashboard's header shows
        assert main(["runs", "show", str(finished), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["summary"]["n_steps"] == 3
    assert state(tmp_path) == before


def test_a_wal_without_its_index_on_a_read_only_disk_is_named(tmp_path, capsys):
    # The one record a read-only disk cannot give: a killed run's WAL whose -shm index was lost. It is named with
    # what to do, and the other runs are still listed.
    root = tmp_path / "runs"
    finished_run(root / "good")
    broken = killed_run(root / "noindex")
    wal_files(broken)[1].unlink()
    with read_only(tmp_path):
        assert main(["runs", "--root", str(root)]) == 1
        out, err = capsys.readouterr()
        assert "good" in out and "finished" in out and "unreadable" in out and str(broken) in out
        assert "run.db-shm is missing" in err and "copy the run folder somewhere writable" in err
        with pytest.raises(UnreadableRecordError, match="copy the run folder"):
            connect_ro(broken)


def test_eval_refuses_a_read_only_run_before_computing(tmp_path, capsys):
    # Could fail if `bapo eval --run` loaded the model and sampled before finding it cannot record the results.
    run = finished_run(tmp_path / "ro")
    with read_only(tmp_path):
        assert main(["eval", "countdown-tiny", "--task", "countdown", "--limit", "1", "--k", "1",
                     "--run", str(run)]) == 2
        out, err = capsys.readouterr()
    assert out == ""  # no table: nothing was computed
    assert err.count("\n") == 1 and f"--run {run}" in err and "read-only" in err and "drop --run" in err


def test_eval_refuses_a_damaged_run_record_before_computing(tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "run.db").write_bytes(b"not a database " * 100)
    assert main(["eval", "countdown-tiny", "--task", "countdown", "--run", str(tmp_path / "bad")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "bad/run.db is not a readable run record" in err


def damaged_runs(root: Path) -> dict[str, Path]:
    """A good run beside three damaged records: garbage, a truncated record, an empty file."""
    good = finished_run(root / "good", steps=40)
    runs = {"good": good}
    for name in ("garbage", "truncated", "empty"):
        (root / name).mkdir(parents=True)
        runs[name] = root / name
    (root / "garbage" / "run.db").write_bytes(b"SQLite format 2\0 but not really " * 200)
    data = (good / "run.db").read_bytes()
    assert len(data) > 8 * 4096  # several pages: the cut leaves the header and the meta table, loses the rest
    (root / "truncated" / "run.db").write_bytes(data[:len(data) // 2])
    (root / "empty" / "run.db").write_bytes(b"")
    return runs


def test_damaged_records_are_reported_per_run(tmp_path, capsys):
    # Could fail if one damaged record crashed the listing (as it did), or `runs show` printed a traceback.
    runs = damaged_runs(tmp_path / "runs")
    assert main(["runs", "--root", str(tmp_path / "runs")]) == 1
    out, err = capsys.readouterr()
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 5}
    assert "finished" in rows["good"] and "40" in rows["good"]
    for name in ("garbage", "truncated", "empty"):
        assert "unreadable" in rows[name] and str(runs[name]) in rows[name]
        assert f"unreadable: {runs[name] / 'run.db'}" in err
    assert err.count("\n") == 3
    for name in ("garbage", "truncated", "empty"):
        for json_flag in ([], ["--json"]):
            assert main(["runs", "show", str(runs[name]), *json_flag]) == 2
            out, err = capsys.readouterr()
            assert out == "" and err.count("\n") == 1, err
            assert err.startswith(f"bapo: {runs[name] / 'run.db'} is not a readable run record")
    assert main(["runs", "show", "good", "--root", str(tmp_path / "runs")]) == 0


def test_runs_of_one_name_in_two_folders(tmp_path, capsys):
    # Could fail if `bapo runs` did not tell them apart (the path column) or `runs show NAME` picked one silently.
    a = finished_run(tmp_path / "runs" / "sweep1" / "r", name="same")
    b = finished_run(tmp_path / "runs" / "sweep2" / "r", name="same")
    assert main(["runs", "--root", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert str(a) in out and str(b) in out
    assert main(["runs", "show", "same", "--root", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "2 runs" in err and str(a) in err and str(b) in err
    assert main(["runs", "show", str(b)]) == 0
