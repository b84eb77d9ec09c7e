"""The `bapo` command line on the default (tiny) preset: every algorithm preset runs, runs are listed and shown."""
import json

import pytest

from bapo_vl.cli import main

SMALL = ["steps=2", "batch_size=4", "group_size=4", "max_response_length=24", "reeval_every=1", "delay=2"]


@pytest.mark.parametrize("algo", ["bapo", "grpo", "dapo", "mini_test"])
def test_train_runs_each_algorithm_on_the_default_preset(tmp_path, capsys, algo):
    assert main(["train", "--quiet", f"algo={algo}", f"run_dir={tmp_path}", f"name={algo}", *SMALL]) == 0
    capsys.readouterr()
    assert main(["runs", "show", algo, "--root", str(tmp_path), "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["config"]["algo"] == algo
    assert [s["step"] for s in run["steps"]] == [1, 2]
    assert run["meta"]["status"] == "finished"
    step = run["steps"][0]
    for key in ("x1", "x2", "x3", "batch_size", "bins", "bad_size", "high_size", "c2", "c3", "r_tot", "rollouts",
                "fresh_reward", "t_generate", "t_verify", "t_train", "t_sync"):
        assert key in step, key
    assert "t_score" not in step  # the verifier's seconds are t_verify
    assert sum(step["bins"]) * 4 == step["rollouts_fresh"]  # every fresh group lands in one bin
    if algo == "grpo":
        assert all(s["x2"] == 0 and s["x3"] == 0 for s in run["steps"])


def test_runs_list_and_unknown_run(tmp_path, capsys):
    assert main(["train", "--quiet", f"run_dir={tmp_path}", "name=one", *SMALL]) == 0
    capsys.readouterr()
    assert main(["runs", "--root", str(tmp_path)]) == 0
    assert "one" in capsys.readouterr().out
    assert main(["runs", "show", "nope", "--root", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err


def test_runs_show_gives_each_steps_gpu_memory(tmp_path, capsys):
    # Could fail if the table left out what a GPU run records of its memory, or printed a CPU run's absent figure as 0.
    from bapo_vl.record import RunRecord

    with RunRecord.create(tmp_path / "gpu", {}) as record:
        for step, (generate, train) in enumerate([(64.7, 68.0), (80.4, 80.82)], start=1):
            record.log_step(step, dict(rollouts=8, t_generate=1.0, gpu_memory_generate_gb=generate,
                                       gpu_memory_train_gb=train))
    assert main(["train", "--quiet", f"run_dir={tmp_path}", "name=cpu", *SMALL]) == 0
    capsys.readouterr()
    for name, cells in (("gpu", [["64.7", "68.0"], ["80.4", "80.8"]]), ("cpu", [["-", "-"], ["-", "-"]])):
        assert main(["runs", "show", name, "--root", str(tmp_path)]) == 0
        out = capsys.readouterr().out.translate({ord(c): " " for c in "│┃"})  # rich's column rules
        rows = [line.split() for line in out.splitlines()]
        header = next(r for r in rows if "step" in r and "train" in r)
        steps = [r for r in rows if r and r[0] in ("1", "2")]
        assert header[-4:] == ["gen", "GB", "train", "GB"] and [r[-2:] for r in steps] == cells, name


def test_bad_override_is_a_clear_error(tmp_path, capsys):
    assert main(["train", f"run_dir={tmp_path}", "lerning_rate=1"]) == 2
    assert "unknown config key 'lerning_rate'" in capsys.readouterr().err


def test_tasks_lists_bundled_plugins(capsys):
    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert "countdown" in out and "geometry3k" in out


def test_resume_continues_from_the_latest_checkpoint(tmp_path, capsys):
    unfiltered = [*SMALL, "online_filter=none"]  # every group trained on, so each step is an update
    assert main(["train", "--quiet", f"run_dir={tmp_path}", "name=r", *unfiltered]) == 0
    run_dir = tmp_path / "r"
    assert (run_dir / "checkpoints" / "step_2" / "state.pt").is_file()
    assert main(["train", "--quiet", f"resume={run_dir}", "steps=3"]) == 0  # the rest from the record
    capsys.readouterr()
    assert main(["runs", "show", str(run_dir), "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in run["steps"]] == [1, 2, 3]
    # the version counter continues from the checkpoint (a restart at 0 would give 0 or 1 here)
    before, after = run["steps"][1], run["steps"][2]
    assert before["policy_version"] == sum(1 for s in run["steps"][:2] if s["trained_groups"])
    assert after["policy_version"] == before["policy_version"] + (1 if after["trained_groups"] else 0)
    assert before["policy_version"] >= 1, "no update before the checkpoint: the test proves nothing"
    assert run["meta"]["status"] == "finished"


def test_progress_names_a_gpu_steps_memory(capsys):
    # Could fail if the step line left out the most a GPU step held of its card (what says, step by step, how close a
    # run is to running out of memory), or invented one for a CPU run.
    from bapo_vl.train import Progress

    step = dict(fresh_reward=0.25, x1=4, x2=0, x3=1, bad_size=2, high_size=3)
    progress = Progress(total=2, start=0, quiet=False, every=0.0)
    progress.update(1, step)
    progress.update(2, step | dict(gpu_memory_generate_gb=100.46, gpu_memory_train_gb=58.3))
    cpu, gpu = capsys.readouterr().err.splitlines()
    assert cpu.endswith("B_high 3") and gpu.endswith("B_high 3 GPU 100.5 GB")


def test_progress_without_a_terminal_and_quiet(tmp_path):
    # Could fail if progress showed only on a TTY (a run redirected to a file said nothing for its whole length), or
    # if --quiet still printed progress bars (ours or transformers' loading bars).
    import subprocess
    import sys

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "bapo_vl.cli", "train", *extra, f"run_dir={tmp_path}",
                               *SMALL, "steps=3"], capture_output=True, text=True, timeout=600)

    loud = run("name=loud")
    assert loud.returncode == 0, loud.stderr[-2000:]
    assert "step 1/3" in loud.stderr and "step 3/3" in loud.stderr and "|X1|" in loud.stderr
    quiet = run("--quiet", "name=quiet")
    assert quiet.returncode == 0 and quiet.stderr.strip() == "", quiet.stderr[-2000:]
