"""A run killed with SIGKILL anywhere resumes with `bapo train resume=RUN_DIR` and then records exactly what an
uninterrupted run of the same seed records: the same X1/X2/X3 uids, rewards and losses at every step, no step
missing or twice. Real processes, real SIGKILL, the bundled tiny countdown policy on CPU.

Each crash is injected in a child process by wrapping one function just before the kill point (the code under
test is unchanged): mid-step after generation (inside the update), halfway through writing a checkpoint's
state.pt, and right after a step was committed to the record but before its checkpoint."""
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_vl.cli import main
from bapo_vl.record import lock_run_dir

ARGS = ["steps=6", "batch_size=4", "group_size=4", "delay=2", "reeval_every=2",
        "c1=0.25", "save_every=2", "seed=11"]

CHILD = r'''
import io, os, signal, sys
import torch
from bapo_vl import train as T
from bapo_vl.backends.embedded import EmbeddedBackend
from bapo_vl.cli import main

point, at, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if point == "update":  # mid-step: the step's groups are generated and verified, the update has begun
    real_update = EmbeddedBackend.update
    EmbeddedBackend.update = lambda self, batch: die() if batch.step == at else real_update(self, batch)
elif point == "state_write":  # half of the checkpoint's state.pt is on disk
    real_save = torch.save
    def save(obj, f, *a, **k):
        if str(f).endswith(T.STATE) and f"step_{at}" in str(f):
            buf = io.BytesIO()
            real_save(obj, buf)
            with open(f, "wb") as fh:
                fh.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                fh.flush()
            die()
        return real_save(obj, f, *a, **k)
    torch.save = save
elif point == "after_log":  # the step is in the record, its checkpoint is not written yet
    real_log = T.RunRecord.log_step
    def log_step(self, step, *a, **k):
        real_log(self, step, *a, **k)
        if step == at:
            die()
    T.RunRecord.log_step = log_step
sys.exit(main(argv))
'''


def bapo(*argv, kill: tuple[str, int] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    point, at = kill or ("none", 0)
    cmd = [sys.executable, "-c", CHILD, point, str(at), "train", "--quiet", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def per_step(run_dir: Path) -> dict:
    """What must match between runs: per step, the groups (uid, subset, correct), the sampled responses and the
    metrics that do not measure time."""
    db = sqlite3.connect(run_dir / "run.db")
    try:
        steps = {s: json.loads(m) for s, m in db.execute("SELECT step, metrics FROM steps ORDER BY step")}
        groups = db.execute("SELECT step, uid, subset, correct, G FROM prompt_steps ORDER BY step, subset, uid").fetchall()
        samples = db.execute("SELECT step, uid, subset, idx, response, reward, verdict FROM samples "
                             "ORDER BY step, subset, uid, idx").fetchall()
    finally:
        db.close()
    timeless = {s: {k: v for k, v in m.items() if not k.startswith("t_")} for s, m in steps.items()}
    return {"steps": timeless, "groups": groups, "samples": samples}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("reference")
    done = bapo(f"run_dir={root}", "name=ref", *ARGS)
    assert done.returncode == 0, done.stderr[-3000:]
    ref = per_step(root / "ref")
    assert list(ref["steps"]) == [1, 2, 3, 4, 5, 6]
    subsets = {s for _, _, s, _, _ in ref["groups"]}
    assert {"x1", "x3"} <= subsets and ({"x2", "not_promoted"} & subsets), f"X2/X3 not exercised: {subsets}"
    return ref


@pytest.mark.parametrize("point, at, resumes_from", [
    ("update", 3, 2),  # killed inside step 3's update: step 2's checkpoint is the latest
    ("state_write", 4, 2),  # killed while writing step 4's checkpoint: it must not count
    ("after_log", 4, 2),  # step 4 is in the record, its checkpoint is not: the record loses step 4 on resume
    ("update", 6, 4),  # killed in the last step
])
def test_killed_run_resumes_to_the_same_record(reference, tmp_path, capsys, point, at, resumes_from):
    run_dir = tmp_path / "crash"
    crashed = bapo(f"run_dir={tmp_path}", "name=crash", *ARGS, kill=(point, at))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    complete = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith("."))
    assert complete[-1] == f"step_{resumes_from}"  # a half-written checkpoint is never a step_N folder
    if point == "state_write":
        assert (run_dir / "checkpoints" / f".step_{at}.partial").is_dir()
    assert main(["runs", "--root", str(tmp_path)]) == 0  # the record still says running; no trainer holds it
    assert "stopped (killed?)" in capsys.readouterr().out
    resumed = bapo(f"resume={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = per_step(run_dir)
    assert list(got["steps"]) == [1, 2, 3, 4, 5, 6]  # none missing, none twice (steps is keyed by step)
    for t in range(1, 7):
        assert got["steps"][t] == reference["steps"][t], f"step {t} differs after resuming from {resumes_from}"
    assert got["groups"] == reference["groups"]
    assert got["samples"] == reference["samples"]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]  # no partial left
    status = sqlite3.connect(run_dir / "run.db").execute("SELECT value FROM meta WHERE key='status'").fetchone()[0]
    assert status == "finished"


def test_a_second_trainer_is_refused_and_loses_nothing(tmp_path, capsys):
    # Could fail if two processes could append to one record (interleaved, duplicated steps) or if the refusal
    # changed the record it refused to write.
    assert main(["train", "--quiet", f"run_dir={tmp_path}", "name=busy", *ARGS[1:], "steps=2"]) == 0
    run_dir = tmp_path / "busy"
    before = per_step(run_dir)
    held = lock_run_dir(run_dir)  # another trainer holds the directory
    try:
        capsys.readouterr()
        assert main(["train", "--quiet", f"resume={run_dir}", "steps=3"]) == 2
        err = capsys.readouterr().err
        assert "being written by another trainer" in err and str(os.getpid()) in err
    finally:
        held.close()
    assert per_step(run_dir) == before
    assert main(["train", "--quiet", f"resume={run_dir}", "steps=3"]) == 0  # free again once the holder is gone
    assert list(per_step(run_dir)["steps"]) == [1, 2, 3]


def test_resume_takes_the_recorded_config_and_refuses_changes(tmp_path, capsys):
    # Could fail if resume=DIR alone fell back to the preset's defaults (other batch size, seed, steps), or if an
    # override that changes the run (here the batch size) were accepted silently.
    assert main(["train", "--quiet", f"run_dir={tmp_path}", "name=r", *ARGS[1:], "steps=2"]) == 0
    run_dir = tmp_path / "r"
    capsys.readouterr()
    assert main(["train", "--quiet", f"resume={run_dir}", "batch_size=8"]) == 2
    err = capsys.readouterr().err
    assert "batch_size: recorded 4, given 8" in err
    assert list(per_step(run_dir)["steps"]) == [1, 2]  # the refused resume removed nothing
    assert main(["train", "--quiet", f"resume={run_dir}", "steps=3"]) == 0
    assert list(per_step(run_dir)["steps"]) == [1, 2, 3]


def test_resume_falls_back_to_the_newest_checkpoint_that_loads(reference, tmp_path, caplog):
    # Could fail if a checkpoint damaged after it was written (here: its state.pt cut in half) stopped the resume,
    # or if the fallback lost the exactness of the resumed run.
    assert main(["train", "--quiet", f"run_dir={tmp_path}", "name=f", *ARGS[1:], "steps=4"]) == 0
    run_dir = tmp_path / "f"
    state = run_dir / "checkpoints" / "step_4" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    assert main(["train", "--quiet", f"resume={run_dir}", "steps=6"]) == 0
    assert "step_4 does not load" in caplog.text
    got = per_step(run_dir)
    assert list(got["steps"]) == [1, 2, 3, 4, 5, 6]
    assert got["steps"] == reference["steps"] and got["groups"] == reference["groups"]
