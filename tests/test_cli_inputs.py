"""Bad inputs that another library used to answer (Gradio, Python's int limit, the hub, a TypeError, a broken pipe)
end in ONE line of ours, `bapo: ...`, naming the item and what to do, before any model loads."""
import importlib.metadata
import socket
import subprocess
import sys

import pytest

from bapo_vl.cli import main


def refused(capsys, argv: list[str], code: int = 2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("bapo: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_dashboard_port_in_use(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = refused(capsys, ["dashboard", str(tmp_path), "--port", str(port)])
    assert f"--port {port}" in err and "choose another --port" in err and "GRADIO_SERVER_PORT" not in err, err


def test_dashboard_port_out_of_range(tmp_path, capsys):
    err = refused(capsys, ["dashboard", str(tmp_path), "--port", "99999"])
    assert "--port 99999" in err and "1 to 65535" in err, err


def test_a_number_too_long_to_read(tmp_path, capsys):
    err = refused(capsys, ["train", "steps=" + "9" * 5000, f"run_dir={tmp_path}"])
    assert err.startswith("bapo: steps='999") and "(5,000 characters)" in err and len(err) < 300, err
    assert "set_int_max_str_digits" not in err


def test_a_huge_unknown_key_is_not_echoed_whole(tmp_path, capsys):
    err = refused(capsys, ["train", "k" * 100_000 + "=1", f"run_dir={tmp_path}"])
    assert "unknown config key" in err and "(100,000 characters)" in err and len(err) < 300, err


def test_eval_of_a_run_folder_that_does_not_exist(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    err = refused(capsys, ["eval", "runs/nonexistent", "--task", "countdown"])
    assert "runs/nonexistent" in err and "does not exist" in err and "huggingface.co" not in err, err


def test_uncached_hub_model_names_the_installed_download_command(tmp_path, capsys):
    err = refused(capsys, ["train", "model=org/not-cached", f"run_dir={tmp_path}"])
    assert "`hf download org/not-cached --local-dir /local/path`" in err and "huggingface-cli" not in err, err
    # the command named is the one the installed huggingface_hub provides (huggingface-cli is its deprecated stub)
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["hf"].startswith("huggingface_hub.") and "deprecated" in scripts.get("huggingface-cli", "deprecated")


def test_an_empty_source_file_is_named_before_the_model_loads(tmp_path, capsys):
    empty = tmp_path / "train.jsonl"
    empty.write_text("")
    err = refused(capsys, ["train", f"task_options={{source: {empty}}}", f"run_dir={tmp_path / 'runs'}"])
    assert f"{empty}: the file holds no rows" in err, err  # one line: no weights were loaded before it
    assert not (tmp_path / "runs").exists()


def test_report_to_a_sink_whose_package_is_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # how Python marks a module as not importable
    err = refused(capsys, ["train", "report_to=[tensorboard]", f"run_dir={tmp_path}", "name=tb"])
    assert "report_to=tensorboard" in err and "pip install 'bapo-vl[tensorboard]'" in err, err
    assert not (tmp_path / "tb").exists()  # no folder holding only a lock


def test_eval_option_the_task_does_not_take(capsys):
    err = refused(capsys, ["eval", "countdown-tiny", "--task", "countdown", "--option", "bogus=1"])
    assert "--option" in err and "'bogus'" in err and "it takes: source, template" in err, err


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`bapo tasks | head -0`: our output goes to a pipe whose reader has left."""
    p = subprocess.Popen([sys.executable, "-m", "bapo_vl.cli", "tasks"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("setting", ["top_p=2.0", "steps=abc", "algo=bogus", "loss_agg=bogus"])
def test_a_bad_setting_is_refused_before_torch_loads(tmp_path, setting):
    # Could fail if bapo_vl.config imported torch again (through the losses), or `bapo train` imported the trainer
    # before checking its settings: the one line would then wait for torch (seconds, tens of them under load).
    code = ("import sys\nfrom bapo_vl.cli import main\n"
            f"rc = main(['train', {setting!r}, 'run_dir={tmp_path}'])\n"
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "False"], (out.stdout, out.stderr[-2000:])
    assert out.stderr.startswith(f"bapo: {setting.split('=')[0]}=") and out.stderr.count("\n") == 1, out.stderr


def test_a_prompt_longer_than_max_prompt_length_is_named_before_the_weights_load(tmp_path, capsys):
    # Could fail if the too-long prompt were found only by the first step's encode, after the weights load, in a
    # run folder then marked failed. The policy's weights are removed, so loading them would fail another way.
    from bapo_vl.tiny import build_qwen2_5_vl

    model, processor = build_qwen2_5_vl(max_pixels=112 * 112)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    for weights in (tmp_path / "vl").glob("*.safetensors"):
        weights.unlink()
    capsys.readouterr()  # the save's progress bar
    runs = tmp_path / "runs"
    err = refused(capsys, ["train", "task=geodraw", f"model={tmp_path / 'vl'}", "max_prompt_length=64",
                           "task_options={image_size: 112, n: 40}", f"run_dir={runs}", "device=cpu"])
    assert "max_prompt_length=64" in err and "prompt geodraw-train-" in err, err
    assert not runs.exists()
