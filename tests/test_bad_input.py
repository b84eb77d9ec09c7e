"""Every bad input to `bapo train` fails at start with ONE line, `bapo: ...`, naming the key, file or run and what to
do (exit code 2), and no traceback unless --debug; a failure during training (a full disk) ends in one line too (exit
code 1) with the run marked failed and its earlier checkpoint intact; so does the GPU's memory running out, naming
the phase and the settings that lower its need.

The CLI runs in-process (main(), output through capsys) on the bundled tiny policy, except the real full disk: a
small tmpfs in a private mount namespace (`unshare`), skipped where that is not allowed."""
import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from bapo_vl.cli import main
from bapo_vl.config import Config, ConfigError

SMALL = ["batch_size=2", "group_size=2", "max_response_length=8", "delay=1"]  # the smallest step that still trains

# (key, value as typed after key=, what the message must say besides the key)
BAD_VALUES = [
    ("steps", "0", "must be >= 1"),
    ("steps", "-5", "must be >= 1"),
    ("top_p", "2", "must be > 0 and <= 1"),
    ("temperature", "0", "must be > 0"),
    ("device", "tpu", "choose one of auto, cpu, cuda"),
    ("dtype", "fp16", "choose one of auto, float32, bfloat16"),
    ("c2_range", "5", "a pair [low, high]"),
    ("c2_range", "[0.5, 0.2]", "low <= high"),
    ("task_options", "notadict", "must be a mapping"),
    ("tasks_dirs", "/x", "e.g. tasks_dirs=[/x]"),  # a string would be iterated character by character
    ("use_x2", "1", "true or false"),
    ("report_to", "[tensorbord]", "choose from tensorboard, wandb"),
]


def refused(capsys, argv: list[str], code: int = 2) -> str:
    """main(argv)'s one stderr line, after checking the exit code and that no traceback was printed."""
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("bapo: ") and "\n" not in err and "Traceback" not in err, err
    return err


def statuses(run_dir: Path) -> tuple[str, list[int]]:
    db = sqlite3.connect(run_dir / "run.db")
    try:
        status = db.execute("SELECT value FROM meta WHERE key = 'status'").fetchone()[0]
        return status, [s for (s,) in db.execute("SELECT step FROM steps ORDER BY step")]
    finally:
        db.close()


# --- config values: the same check from key=value, a YAML file and Python ---------------------------------------


@pytest.mark.parametrize("key, text, says", BAD_VALUES)
def test_bad_value_on_the_command_line(tmp_path, capsys, key, text, says):
    err = refused(capsys, ["train", f"run_dir={tmp_path / 'runs'}", f"{key}={text}"])
    assert err.startswith(f"bapo: {key}=") and says in err
    assert not (tmp_path / "runs").exists()  # refused before anything was written


@pytest.mark.parametrize("key, text, says", BAD_VALUES)
def test_bad_value_in_a_yaml_file_names_the_file(tmp_path, capsys, key, text, says):
    path = tmp_path / "my.yaml"
    path.write_text(f"{key}: {text}\n")
    # key=value after --config: argparse alone would refuse it as an unrecognised argument
    err = refused(capsys, ["train", "--config", str(path), f"run_dir={tmp_path / 'runs'}"])
    assert err.startswith(f"bapo: {path}: {key}=") and says in err


@pytest.mark.parametrize("key, text, says", BAD_VALUES)
def test_bad_value_from_python(key, text, says):
    with pytest.raises(ConfigError, match=f"^{key}=") as e:
        Config.from_dict({key: yaml.safe_load(text)})
    assert says in str(e.value) and e.value.key == key


def test_malformed_yaml_names_the_file_and_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("steps: 5\nlr: [1e-6\n")
    err = refused(capsys, ["train", "--config", str(path)])
    assert err.startswith(f"bapo: {path}: not valid YAML at line")


def test_a_yaml_list_is_not_a_config(tmp_path, capsys):
    path = tmp_path / "list.yaml"
    path.write_text("- steps: 5\n- lr: 1e-6\n")
    assert refused(capsys, ["train", "--config", str(path)]) == (
        f"bapo: {path}: a config file holds `key: value` lines, not a list")


def test_unknown_key_in_a_yaml_file(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    path.write_text("step: 5\n")
    err = refused(capsys, ["train", "--config", str(path)])
    assert err.startswith(f"bapo: {path}: unknown config key 'step'; did you mean steps")  # no KeyError quotes


# --- what is checked at start, before the task's data or the weights load -------------------------------------


def test_missing_tasks_dir(tmp_path, capsys):
    err = refused(capsys, ["train", f"run_dir={tmp_path}", f"tasks_dirs=[{tmp_path / 'nope'}]"])
    assert err.startswith(f"bapo: tasks_dirs: {tmp_path / 'nope'} is not a folder")


def test_missing_model_folder(tmp_path, capsys):
    err = refused(capsys, ["train", f"run_dir={tmp_path}", "model=/nonexistent"])
    assert err.startswith("bapo: model=/nonexistent: no such folder")


@pytest.mark.parametrize("argv, model", [
    (["model=Qwen/Qwen2.5-0.5B-Instruct"], "Qwen/Qwen2.5-0.5B-Instruct"),
    (["--preset", "countdown"], "Qwen/Qwen2.5-Math-1.5B"),  # was a 56-line hub traceback
])
def test_uncached_hub_model_offline(tmp_path, capsys, monkeypatch, argv, model):
    import huggingface_hub
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        pytest.skip(f"{model} is in this machine's hub cache: it would load")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 (conftest sets it)
    err = refused(capsys, ["train", *argv, f"run_dir={tmp_path}"])
    assert err.startswith(f"bapo: model={model}: ") and "HF_HUB_OFFLINE" in err and "model=/local/path" in err


def test_task_options_the_task_refuses(tmp_path, capsys):
    # the tiny preset's task_options.template=compact belongs to countdown, not to math
    err = refused(capsys, ["train", f"run_dir={tmp_path}", "task=math"])
    assert err.startswith("bapo: task=math task_options={template: compact}: unknown template 'compact'")


def test_unknown_task(tmp_path, capsys):
    assert refused(capsys, ["train", f"run_dir={tmp_path}", "task=nope"]).startswith("bapo: unknown task 'nope'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu(tmp_path, capsys):
    assert refused(capsys, ["train", f"run_dir={tmp_path}", "device=cuda"]).startswith("bapo: device=cuda: ")


def test_resume_of_a_folder_without_a_run(tmp_path, capsys):
    err = refused(capsys, ["train", f"resume={tmp_path}"])
    assert err.startswith(f"bapo: resume={tmp_path}: no run record {tmp_path / 'run.db'}")


def test_debug_adds_the_traceback(tmp_path, capsys):
    assert main(["train", "--debug", f"run_dir={tmp_path}", "steps=0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == "bapo: steps=0: must be >= 1"


@pytest.mark.parametrize("command", ["train", "runs", "tasks", "eval", "dashboard"])
def test_every_subcommand_documents_debug(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--debug" in capsys.readouterr().out


# --- an existing run: its name, its checkpoints ---------------------------------------------------------------


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A finished 2-step run with a checkpoint after each step."""
    root = tmp_path_factory.mktemp("runs")
    assert main(["train", "--quiet", f"run_dir={root}", "name=base", "steps=2", "save_every=1", *SMALL]) == 0
    return root / "base"


@pytest.fixture
def run_copy(base_run, tmp_path) -> Path:
    return Path(shutil.copytree(base_run, tmp_path / "run"))


def test_a_run_name_in_use(base_run, capsys):
    err = refused(capsys, ["train", f"run_dir={base_run.parent}", "name=base", "steps=1", *SMALL])
    assert err == (f"bapo: name=base: {base_run} already holds a run; choose another name=, or continue it with "
                   f"resume={base_run}")
    assert statuses(base_run) == ("finished", [1, 2])


def test_empty_latest_and_garbage_checkpoint_are_skipped(run_copy, capsys, caplog):
    # Could fail if a stray file or a folder that merely looks like a checkpoint stopped (or misled) the resume.
    (run_copy / "checkpoints" / "latest").write_text("")
    (run_copy / "checkpoints" / "step_7").mkdir()
    (run_copy / "checkpoints" / "step_7" / "state.pt").write_bytes(b"garbage")
    assert main(["train", "--quiet", f"resume={run_copy}"]) == 0  # from step 2, the last: nothing left to train
    assert "step_7 does not load" in caplog.text and "step_2 does not load" not in caplog.text
    assert statuses(run_copy) == ("finished", [1, 2])


def test_truncated_state_falls_back_to_the_earlier_checkpoint(run_copy, caplog):
    state = run_copy / "checkpoints" / "step_2" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    assert main(["train", "--quiet", f"resume={run_copy}"]) == 0
    assert "step_2 does not load" in caplog.text
    assert statuses(run_copy) == ("finished", [1, 2])  # step 2 trained again from step 1's checkpoint
    torch.load(state, weights_only=False)  # and its checkpoint written whole again


def test_no_checkpoint_loads(run_copy, capsys):
    for step in (1, 2):
        (run_copy / "checkpoints" / f"step_{step}" / "state.pt").write_bytes(b"")
    err = refused(capsys, ["train", "--quiet", f"resume={run_copy}"])
    assert err == (f"bapo: resume={run_copy}: no checkpoint in {run_copy / 'checkpoints'} loads (tried steps 2, 1); "
                   f"to train the run again from step 0, remove {run_copy / 'checkpoints'} and resume")
    assert statuses(run_copy) == ("finished", [1, 2])  # the record is left as it was


# --- a full disk while writing a checkpoint ---------------------------------------------------------------------


def test_disk_full_during_a_checkpoint(tmp_path, capsys, monkeypatch):
    # Each write to step 2's checkpoint fails as on a full disk (after writing part of the file). Could fail if the
    # error surfaced as a traceback, the run stayed "running", or step 1's checkpoint or the partial one were lost.
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if ".step_2.partial" in str(f):
            Path(f).write_bytes(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    err = refused(capsys, ["train", "--quiet", f"run_dir={tmp_path}", "name=full", "steps=2", "save_every=1",
                           *SMALL], code=1)
    run_dir = tmp_path / "full"
    assert err.startswith("bapo: training failed: OSError: [Errno 28] No space left on device")
    assert f"{run_dir} is marked failed; `bapo train resume={run_dir}` continues it from checkpoint step_1" in err
    assert statuses(run_dir) == ("failed", [1, 2])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1"]  # no .partial left
    torch.load(run_dir / "checkpoints" / "step_1" / "state.pt", weights_only=False)


CHECK = """import json, pathlib, sqlite3, sys, torch
d = pathlib.Path(sys.argv[1])
status = sqlite3.connect(d / "run.db").execute("SELECT value FROM meta WHERE key = 'status'").fetchone()[0]
checkpoints = sorted(p.name for p in (d / "checkpoints").iterdir())
for name in checkpoints:
    torch.load(d / "checkpoints" / name / "state.pt", weights_only=False)
print(json.dumps({"status": status, "checkpoints": checkpoints}))"""


def test_real_full_disk(base_run, tmp_path):
    # A tmpfs with room for the record and about 1.5 checkpoints: a checkpoint write fills it. Could fail as it did:
    # torch reports a full disk as a RuntimeError ("unexpected pos"), and the failed writer's open file kept the
    # partial checkpoint's room (even after removal) so that the record could not say "failed".
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no private mount namespace here (unshare -rm)")
    checkpoint = sum(f.stat().st_size for f in (base_run / "checkpoints" / "step_1").iterdir())
    size_kb = ((base_run / "run.db").stat().st_size + checkpoint * 3 // 2) // 1024
    disk = tmp_path / "disk"
    disk.mkdir()
    script = ('mount -t tmpfs -o size="$1"k tmpfs "$2" || exit 99; "$3" -m bapo_vl.cli train --quiet run_dir="$2" '
              f'name=full steps=2 save_every=1 {" ".join(SMALL)}; echo "rc=$?"; "$3" -c "$4" "$2/full"')
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(size_kb), str(disk), sys.executable, CHECK],
                          capture_output=True, text=True, timeout=300)
    if done.returncode == 99:
        pytest.skip(f"tmpfs cannot be mounted here: {done.stderr.strip()}")
    err = done.stderr.strip()
    assert "rc=1" in done.stdout and err.startswith("bapo: training failed: OSError: [Errno 28]"), done.stderr
    assert "\n" not in err and ".partial" in err and "is marked failed" in err
    left = json.loads(done.stdout.splitlines()[-1])  # every checkpoint left loads; no partial one is left
    assert left["status"] == "failed" and left["checkpoints"]
    assert all(c.startswith("step_") for c in left["checkpoints"])
    assert err.endswith(f"continues it from checkpoint {left['checkpoints'][-1]} (--debug shows the traceback)")


# --- the GPU's memory runs out ----------------------------------------------------------------------------------
# CUDA cannot run here: torch.OutOfMemoryError is raised where a CUDA allocation would fail, inside the real
# model's decoder layers, and everything around it (the backend's phases, the trainer, the record, the CLI) is real.


def out_of_memory_in(monkeypatch, when):
    """Qwen2's decoder layers raise torch's CUDA out-of-memory error while `when()` holds."""
    from transformers.models.qwen2 import modeling_qwen2

    forward = modeling_qwen2.Qwen2DecoderLayer.forward

    def failing(self, *args, **kwargs):
        if when():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                         "capacity of 79.19 GiB of which 1.06 GiB is free.")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_qwen2.Qwen2DecoderLayer, "forward", failing)


def test_the_update_out_of_gpu_memory(tmp_path, capsys, monkeypatch):
    # The second step's update runs out of memory. Could fail if torch's message came out alone (no phase, no
    # setting to change), as a traceback, or if the run were not marked failed with step 1 and its checkpoint kept.
    run_dir = tmp_path / "oom"
    out_of_memory_in(monkeypatch, lambda: torch.is_grad_enabled() and (run_dir / "checkpoints" / "step_1").exists())
    err = refused(capsys, ["train", "--quiet", f"run_dir={tmp_path}", "name=oom", "steps=3", "save_every=1",
                           "micro_batch_size=2", "online_filter=none", *SMALL], code=1)  # every group is trained
    assert err.startswith("bapo: training failed: OutOfGpuMemory: the update (micro-batches of 2 sequences, responses "
                          "up to "), err
    assert ("ran out of GPU memory: lower micro_batch_size, set gradient_checkpointing=true (each block's "
            "activations recomputed in the backward, about a third more compute), or train on several GPUs with "
            "backend=verl (FSDP shards the weights and AdamW's state)") in err
    assert f"{run_dir} is marked failed; `bapo train resume={run_dir}` continues it from checkpoint step_1" in err
    assert statuses(run_dir) == ("failed", [1])


def tiny_backend():
    """The embedded backend on the bundled tiny policy, and two countdown prompts encoded for it."""
    from bapo_vl.config import load_config
    from bapo_vl.plugins import get_task
    from bapo_vl.train import make_backend

    backend = make_backend(load_config(overrides=["task=countdown", "task_options={template: compact}",
                                                  "max_prompt_length=96", "model=countdown-tiny", "device=cpu",
                                                  "dtype=float32", "max_response_length=8", "generate_batch_size=3",
                                                  "score_batch_size=5"]))
    return backend, [backend.encode(p) for p in get_task("countdown").load(split="train", template="compact")[:2]]


@pytest.mark.parametrize("phase", ["sample", "score"])
def test_sampling_and_scoring_out_of_gpu_memory(monkeypatch, phase):
    # Could fail if a no-grad phase's out-of-memory error named the update's setting, or none.
    from bapo_vl.backends.gpu_memory import OutOfGpuMemory

    backend, prompts = tiny_backend()
    responses = [r.tokens for group in backend.generate(prompts, 2, logprobs=False) for r in group]
    failing = {"on": True}
    out_of_memory_in(monkeypatch, lambda: failing["on"])
    with pytest.raises(OutOfGpuMemory) as e:
        if phase == "sample":
            backend.generate(prompts, 2)
        else:
            backend.score(backend.rollout, [p for p in prompts for _ in range(2)], responses)
    expected = ("sampling 3 responses of up to 8 tokens ran out of GPU memory: lower generate_batch_size (now 3), or "
                "sample with rollout_engine=vllm (its KV cache is paged, and sized to the card)") if phase == "sample" \
        else (f"scoring log-probs of 4 sequences (responses up to {max(map(len, responses))} tokens) ran out of GPU "
              "memory: lower score_batch_size (now 5)")
    assert str(e.value) == expected
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)  # torch's own message stays in the chain


def test_an_engine_that_cannot_wake_does_not_hide_the_update_running_out_of_memory(monkeypatch, caplog):
    # A colocated vLLM engine sleeps through each update and wakes after it; after the update ran out of memory its
    # tensors (held by the error) can leave the engine no room to wake. Could fail if the engine's error replaced
    # the update's, which names the settings to lower, or if a failed update skipped the wake it may still manage.
    from bapo_vl.backends.base import UpdateBatch
    from bapo_vl.backends.gpu_memory import OutOfGpuMemory

    backend, prompts = tiny_backend()
    groups = tuple(tuple(group) for group in backend.generate(prompts, 2))
    batch = UpdateBatch(prompts=tuple(prompts), responses=groups, rewards=((1.0, 0.0), (0.0, 1.0)),
                        advantages=((1.0, -1.0), (-1.0, 1.0)), step=1)

    class Engine:  # what update() asks of a colocated vLLM engine (vLLM cannot run here)
        def __init__(self):
            self.calls = []

        def sleep(self):
            self.calls.append("sleep")

        def wake(self):
            self.calls.append("wake")
            raise RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp:62")  # as vLLM's allocator says

    backend.engine = engine = Engine()
    out_of_memory_in(monkeypatch, torch.is_grad_enabled)
    with pytest.raises(OutOfGpuMemory, match="^the update .* ran out of GPU memory: lower micro_batch_size"):
        backend.update(batch)
    assert engine.calls == ["sleep", "wake"]
    assert "the rollout engine did not wake after the failed update: CUDA Error: out of memory" in caplog.text
