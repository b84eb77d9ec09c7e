"""Faults a user can walk into around resume and checkpoints, tried as a user would: real runs of the bundled tiny
policy on CPU, real SIGKILLs (the child process of test_crash_resume), the real record and saved checkpoints.

- a run killed before its first checkpoint (save_every=0: the whole run) resumes: it starts again from step 0;
- an extended resume (steps=N) that is killed is finished by a plain resume (the record keeps the new steps);
- checkpoints load with weights_only=True: a checkpoint file whose unpickling would run code runs nothing, and it,
  a damaged and a foreign file are each refused in one line naming the file;
- old checkpoints are pruned (keep_checkpoints), only after a newer one is written whole, and resume still works;
- save_every=-1 writes nothing but the record: the run finishes with its steps recorded and no weights on disk.
Every resumed run is compared with an uninterrupted one of the same seed, step by step."""
import errno
import json
import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch

from bapo_vl.cli import main
from bapo_vl.record import query_ro, read_meta
from test_crash_resume import bapo, per_step

ARGS = ["batch_size=4", "group_size=4", "max_response_length=16", "delay=2", "reeval_every=2", "c1=0.25", "seed=11"]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def recorded(run_dir: Path, key: str):
    return json.loads(query_ro(run_dir, "SELECT json FROM config")[0]["json"])[key]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One torch thread here and in the killed children: on a busy 2-core machine two spinning threads made these
    runs 2-5x slower. The same count on both sides, as the step-by-step comparisons need."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 3-step run with a checkpoint after every step; the default keep_checkpoints=2 leaves the
    last two."""
    root = tmp_path_factory.mktemp("reference")
    assert main(["train", "--quiet", f"run_dir={root}", "name=ref", *ARGS, "steps=3", "save_every=1"]) == 0
    return root / "ref"


def test_old_checkpoints_are_pruned(reference):
    # Could fail if checkpoints were never pruned (step_1 would still be there) or if pruning removed the newest or
    # left hidden folders behind.
    assert checkpoints(reference) == ["step_2", "step_3"]
    assert recorded(reference, "keep_checkpoints") == 2


def test_save_every_minus_one_writes_no_weights(tmp_path):
    # Could fail if -1 were read as "every step" (t % -1 == 0), or if the end of the run still wrote a checkpoint
    # or final/ (a benchmark of a 3 B model would fill tens of GB of disk), or left the run unfinished.
    assert main(["train", "--quiet", f"run_dir={tmp_path}", "name=timed", "steps=3", "save_every=-1", *ARGS]) == 0
    run_dir = tmp_path / "timed"
    assert read_meta(run_dir)["status"] == "finished"
    assert [r["step"] for r in query_ro(run_dir, "SELECT step FROM steps ORDER BY step")] == [1, 2, 3]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "final").exists()


def test_a_run_killed_before_its_first_checkpoint_starts_again(reference, tmp_path, caplog):
    # Could fail as it did: resume= said "no checkpoint loads" and the name was refused as "already holds a run",
    # so a run killed before its first checkpoint (with the default save_every=0, any time before its end) was
    # lost. It must start again from step 0 and record exactly what an uninterrupted run records.
    run_dir = tmp_path / "dead"
    killed = bapo(f"run_dir={tmp_path}", "name=dead", *ARGS, "steps=3", kill=("after_log", 2))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (run_dir / "checkpoints").exists() and list(per_step(run_dir)["steps"]) == [1, 2]
    assert main(["train", "--quiet", f"resume={run_dir}"]) == 0
    said = [r.getMessage() for r in caplog.records if "step 0" in r.getMessage()]
    assert said == [f"resume={run_dir}: the run stopped before its first checkpoint; starting it again from step 0"]
    assert per_step(run_dir) == per_step(reference)  # steps 1-2 of the killed run replaced, none twice
    assert read_meta(run_dir)["status"] == "finished" and checkpoints(run_dir) == ["step_3"]


def test_a_killed_extended_resume_is_finished_by_a_plain_resume(reference, tmp_path, capsys):
    # Could fail as it did: the record kept the original steps=1, so after `resume=RUN steps=3` was killed in step
    # 3 (recorded, its checkpoint not yet written), a plain resume=RUN stopped at once, finished after 2 steps.
    # keep_checkpoints=0 on the resume keeps every checkpoint, and the record keeps that too.
    run_dir = tmp_path / "ext"
    assert main(["train", "--quiet", f"run_dir={tmp_path}", "name=ext", *ARGS, "steps=1", "save_every=1"]) == 0
    killed = bapo(f"resume={run_dir}", "steps=3", "keep_checkpoints=0", kill=("after_log", 3))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert recorded(run_dir, "steps") == 3 and recorded(run_dir, "keep_checkpoints") == 0
    assert checkpoints(run_dir) == ["step_1", "step_2"]
    assert main(["train", "--quiet", f"resume={run_dir}"]) == 0
    assert per_step(run_dir) == per_step(reference)  # step 3 trained, and as an uninterrupted run trains it
    assert read_meta(run_dir)["status"] == "finished"
    assert checkpoints(run_dir) == ["step_1", "step_2", "step_3"]
    # steps below what is trained are refused, and the record keeps saying steps=3
    assert main(["train", "--quiet", f"resume={run_dir}", "steps=2"]) == 2
    assert "steps=2: " in capsys.readouterr().err and recorded(run_dir, "steps") == 3


def test_a_failed_checkpoint_write_prunes_nothing(tmp_path, capsys, monkeypatch):
    # Could fail if old checkpoints were removed before the new one was whole: with keep_checkpoints=1, a write of
    # step 2's checkpoint that fails (a full disk) must leave step 1's, the only one to resume from.
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if ".step_2.partial" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    run_dir = tmp_path / "full"
    assert main(["train", "--quiet", f"run_dir={tmp_path}", "name=full", *ARGS, "steps=2", "save_every=1",
                 "keep_checkpoints=1"]) == 1
    assert f"`bapo train resume={run_dir}` continues it from checkpoint step_1" in capsys.readouterr().err
    assert checkpoints(run_dir) == ["step_1"]
    monkeypatch.setattr(torch, "save", real_save)
    assert main(["train", "--quiet", f"resume={run_dir}"]) == 0  # and it resumes from it
    assert checkpoints(run_dir) == ["step_2"]


# --- checkpoint files load without running code -----------------------------------------------------------------


class RunsCode:
    """Unpickling this calls os.system: what a tampered checkpoint could hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def tampered_zip(path: Path, marker: Path):  # torch.save's own format, with the keys a checkpoint has
    torch.save({"policy": RunsCode(marker), "format": RunsCode(marker)}, path)


def tampered_pickle(path: Path, marker: Path):  # a bare pickle, as torch.save wrote it before zip files
    path.write_bytes(pickle.dumps(RunsCode(marker), protocol=2))


def cut_in_half(path: Path, marker: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def foreign(path: Path, marker: Path):  # plain tensors, but not a bapo-vl checkpoint
    torch.save({"weights": torch.zeros(3)}, path)


@pytest.mark.parametrize("spoil, says", [
    (tampered_zip, "refused: it holds posix.system besides tensors and plain data, and loading that could run code"),
    (tampered_pickle, "refused: it holds posix.system besides tensors and plain data"),
    (cut_in_half, "damaged or not a checkpoint (RuntimeError: PytorchStreamReader failed reading zip archive"),
    (foreign, "not a bapo-vl checkpoint (no policy)"),
])
def test_eval_of_a_bad_checkpoint_runs_nothing_and_says_so(reference, tmp_path, capsys, spoil, says):
    # Could fail as it did: backend.pt was unpickled with weights_only=False, so a file whose object runs
    # os.system at load ran it on `bapo eval RUN --checkpoint N`, then printed "bapo: policy".
    run_dir = Path(shutil.copytree(reference, tmp_path / "run"))
    file, marker = run_dir / "checkpoints" / "step_3" / "backend.pt", tmp_path / "ran"
    spoil(file, marker)
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--checkpoint", "3", "--splits", "cd4", "--limit", "2", "--k", "1",
                 "--device", "cpu", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert not marker.exists(), "loading the checkpoint ran its code"
    assert err.startswith(f"bapo: {file}: {says}") and "\n" not in err, err


def test_resume_refuses_a_tampered_state_and_falls_back(reference, tmp_path, caplog):
    # Could fail if the trainer's state.pt were unpickled with code (the marker appears), if the refusal stopped
    # the resume instead of falling back to the checkpoint before it, or if the fallback lost exactness.
    run_dir = Path(shutil.copytree(reference, tmp_path / "run"))
    state, marker = run_dir / "checkpoints" / "step_3" / "state.pt", tmp_path / "ran"
    tampered_zip(state, marker)
    assert main(["train", "--quiet", f"resume={run_dir}"]) == 0
    assert not marker.exists(), "loading the checkpoint ran its code"
    assert f"{run_dir / 'checkpoints' / 'step_3'} does not load ({state}: refused: it holds posix.system" in caplog.text
    assert per_step(run_dir) == per_step(reference)  # step 3 trained again from step 2, as before
    torch.load(state, weights_only=True)  # and written again as tensors and plain data
