"""Every command in README.md's ```bash blocks, run as written.

CASES has one entry per README command, keyed by its text (the trailing comment dropped). A command added to the
README without an entry, or an entry whose command left the README, fails `test_every_readme_command_has_a_case`.
Each command runs through `bapo`'s entry point (bapo_vl.cli.main, in this process: the torch and transformers
imports are paid once) in a folder of its own holding a finished 1-step run `runs/base` (with a checkpoint and
final/), so `./runs`, `runs/<run>` and `RUN` exist. The dashboard, a server, runs as a real `bapo` process until it
answers HTTP. What a case may change, and nothing else:
  fill   README placeholders -> what stands there (`<run>`, `RUN`, `...`, `[optional parts]`); files a command
         names (my.yaml, data/deepscaler.json) are written into its folder, so the text stays as it is
  add    arguments appended only to make a run of minutes take seconds: a 1-step run of 4 prompts x 4 responses
         (SHORT_TRAIN), the first few problems of each eval set (--limit), a free port for a server
Commands that cannot run here (the install, GPU presets, hub models) are skipped, each with its reason.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from bapo_vl.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHORT_TRAIN = "steps=1 batch_size=4 group_size=4"  # the tiny preset trains 60 steps of 32 x 8 (minutes)
GPU_PRESET = ("a paper preset: a 1.5B-3B hub model on one GPU of 80 GB or more (the tests run offline; random models "
              "of these shapes ran on GPUs, docs/results.md)")


@dataclass
class Case:
    fill: dict[str, str] = field(default_factory=dict)
    add: str = ""
    check: Callable[[str, Path], None] | None = None
    server: bool = False
    skip: str | None = None


def shows(*words: str) -> Callable[[str, Path], None]:
    def check(out: str, cwd: Path) -> None:
        for word in words:
            assert word in out, f"{word!r} not in the output:\n{out[-3000:]}"
    return check


def trained(n_runs: int = 3, final: bool = True) -> Callable[[str, Path], None]:
    """The command trained a run: its record is finished and `runs/` holds n_runs (base, other and the new ones);
    final/ holds the policy, or with final=False there is none and the summary says so."""
    def check(out: str, cwd: Path) -> None:
        assert "run record:" in out and "final policy:" in out, out[-3000:]
        run_dir = Path(re.search(r"run record: (\S+)/run\.db", out)[1])
        from bapo_vl.record import read_meta

        assert read_meta(cwd / run_dir)["status"] == "finished"
        assert (cwd / run_dir / "final").is_dir() == final
        assert ("final policy: none (save_every=-1)" in out) != final
        assert len([d for d in (cwd / "runs").iterdir() if (d / "run.db").is_file()]) == n_runs
    return check


def resumed(last_step: int) -> Callable[[str, Path], None]:
    def check(out: str, cwd: Path) -> None:
        from bapo_vl.record import query_ro, read_meta

        assert "run record: runs/base/run.db" in out, out[-3000:]
        assert read_meta(cwd / "runs/base")["status"] == "finished"
        assert query_ro(cwd / "runs/base", "SELECT MAX(step) FROM steps")[0][0] == last_step
    return check


def eval_json(out: str, cwd: Path) -> None:
    result = json.loads((cwd / "eval.json").read_text())
    assert result["k"] == 32 and result["options"] == {"template": "compact"}  # the run's template
    assert json.loads(out) == result


def json_run(out: str, cwd: Path) -> None:
    assert json.loads(out)["meta"]["name"] == "base"


CASES: dict[str, Case] = {
    # --- Set up
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.14.1 torchvision==0.29.1 && pip install '
    '-e . && bapo train': Case(skip="the install, on a fresh machine: CI runs it (.ci/run, command 2); its last part "
                                    "is the `bapo train` case"),
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.14.1 torchvision==0.29.1 && pip install '
    '-e ".[test]" && (command -v chromium >/dev/null || apt-get install -y -q chromium) && pytest -q':
        Case(skip="CI runs exactly this on a fresh clone (.ci/run), this test included"),
    "bapo runs": Case(check=shows("runs under runs/", "base", "finished", "runs/base")),
    "bapo runs show RUN": Case(fill={"RUN": "base"}, check=shows("base  [finished]", "config:", "summary:")),
    "bapo runs show RUN --json": Case(fill={"RUN": "base"}, check=json_run),
    # --- Training
    "bapo train": Case(add=SHORT_TRAIN, check=trained()),
    "bapo train algo=grpo": Case(add=SHORT_TRAIN, check=trained()),
    "bapo train algo=ba_ppo": Case(add=SHORT_TRAIN, check=trained()),
    "bapo train steps=200 lr=1e-4 delay=2": Case(add=SHORT_TRAIN, check=trained()),  # the later steps= counts
    "bapo train --config my.yaml": Case(add=SHORT_TRAIN, check=trained()),
    "bapo train --preset countdown": Case(skip=GPU_PRESET),
    "bapo train --preset countdown device=cuda": Case(skip=GPU_PRESET),
    'bapo train --preset geometry3k task_options="{source: /data/geometry3k}"': Case(skip=GPU_PRESET),
    "bapo train save_every=10 ...": Case(fill={" ...": ""}, add=SHORT_TRAIN, check=trained()),
    "bapo train save_every=-1 ...": Case(fill={" ...": ""}, add=SHORT_TRAIN, check=trained(final=False)),
    "bapo train resume=runs/<run>": Case(fill={"<run>": "base"}, check=resumed(1)),
    "bapo train resume=runs/<run> steps=200": Case(fill={"<run>": "base"}, add="steps=2", check=resumed(2)),
    # --- The dashboard
    "bapo dashboard runs/<run> [runs/<other run> ...]": Case(fill={"<run>": "base", "[runs/<other run> ...]": "runs/other"},
                                                             server=True),
    "bapo dashboard runs/ --host 0.0.0.0 --password SECRET": Case(server=True),
    # --- Tasks and verifiers
    'bapo train task=math task_options="{source: data/deepscaler.json}" model=...':
        Case(fill={"model=...": "model=countdown-tiny"}, add=f"{SHORT_TRAIN} max_prompt_length=200", check=trained()),
    "bapo eval countdown-tiny --task countdown --k 8": Case(add="--limit 2", check=shows("cd34", "cd4", "average",
                                                                                        "mean@8", "pass@8")),
    "bapo eval runs/<run> --k 32 --json --out eval.json": Case(fill={"<run>": "base"}, add="--limit 1", check=eval_json),
    "bapo eval runs/<run> --run runs/<run>": Case(fill={"<run>": "base"}, add="--limit 2",
                                                   check=shows("mean@8", "recorded in runs/base (evals table) at step 1")),
    "bapo eval runs/<run> --k 32 --against start.json": Case(fill={"<run>": "base"}, add="--limit 2",
                                                             check=shows("against start.json (k=8)", "problems paired")),
    "bapo compare start.json --entry grpo=grpo-s0.json,grpo-s1.json --entry bapo=bapo-s0.json,bapo-s1.json "
    "--baseline grpo": Case(check=shows("| start policy | – | 0.000 |", "| grpo | 2 | 0.188", "| bapo | 2 | 0.312",
                                       "| bapo - grpo | +0.125")),
    "bapo eval Qwen/Qwen2.5-Math-1.5B --task math --source path/to/eval_dir --splits aime24,math500":
        Case(skip="Qwen/Qwen2.5-Math-1.5B from the hub (the tests run offline)"),
}

FILES = {  # files README commands name, written into their folder
    "my.yaml": "lr: 1.0e-4\nlog_samples: 2\n",
    "data/deepscaler.json": json.dumps([{"problem": "What is 2 + 3?", "answer": "5"},
                                        {"problem": "What is 7 * 6?", "answer": "42"},
                                        {"problem": "What is 9 - 4?", "answer": "5"},
                                        {"problem": "What is 8 / 2?", "answer": "4"}]),
    "start.json": lambda: json.dumps(start_evaluation()),
    **{f"{algo}-s{seed}.json": (lambda right=right: json.dumps(start_evaluation(right)))  # right of 8, every problem
       for algo, rights in (("grpo", (1, 2)), ("bapo", (2, 3))) for seed, right in enumerate(rights)},
}


def start_evaluation(right: int = 0) -> dict:
    """An earlier `bapo eval --out` result for --against: the base run's eval sets, first two problems, each `right`
    of 8 samples right (none by default)."""
    from bapo_vl.plugins import get_task

    task = get_task("countdown")
    sets = {split: {"problems": {p.uid: right for p in task.load(split=split, template="compact", limit=2)}}
            for split in task.eval_splits}
    return {"task": "countdown", "k": 8, "sets": sets}


def readme_commands() -> list[str]:
    """Each command line of README.md's ```bash blocks, its trailing comment dropped."""
    commands, block = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            block = line.strip() == "```bash" if not block else False
            continue
        text = re.sub(r"\s+#.*$", "", line).strip()
        if block and text and not text.startswith("#"):
            commands.append(text)
    return commands


def test_every_readme_command_has_a_case():
    commands = readme_commands()
    assert len(commands) == len(set(commands)), "a README command is written twice"
    missing = [c for c in commands if c not in CASES]
    gone = [c for c in CASES if c not in commands]
    assert not missing, f"README commands without a case in {__file__}: {missing}"
    assert not gone, f"cases whose command is no longer in the README: {gone}"


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """runs/base: a finished 1-step run of the default preset (checkpoints/step_1, final/)."""
    root = tmp_path_factory.mktemp("readme") / "runs"
    assert main(["train", "--quiet", f"run_dir={root}", "name=base", *SHORT_TRAIN.split()]) == 0
    return root / "base"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(argv: list[str], cwd: Path) -> str:
    """Start the server as a real `bapo` process, wait until it answers HTTP, stop it; its output."""
    port = free_port()
    bapo = Path(sys.executable).with_name("bapo")
    proc = subprocess.Popen([str(bapo), *argv[1:], "--port", str(port)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"{shlex.join(argv)} exited: {proc.stdout.read()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as page:
                    assert page.status == 200
                    return page.read().decode()
            except urllib.error.HTTPError as e:
                return f"HTTP {e.code}"
            except OSError:
                assert time.monotonic() < deadline, f"{shlex.join(argv)}: no answer on port {port} in 120 s"
                time.sleep(0.5)
    finally:
        proc.terminate()  # the server this test started, by its own handle
        proc.wait(timeout=30)


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.skip(reason=case.skip)) if case.skip else c
                                     for c, case in CASES.items()])
def test_readme_command_runs(command, base_run, tmp_path, monkeypatch, capsys):
    case = CASES[command]
    text = command
    for placeholder, value in case.fill.items():
        assert placeholder in text, f"{placeholder!r} is not in {command!r}"
        text = text.replace(placeholder, value)
    assert "<" not in text and "..." not in text and "[" not in text, f"a placeholder is left in {text!r}"
    argv = shlex.split(f"{text} {case.add}")
    assert argv[0] == "bapo"
    for other in ("base", "other"):
        shutil.copytree(base_run, tmp_path / "runs" / other)
    for name, content in FILES.items():
        if name in command:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(content() if callable(content) else content)
    monkeypatch.chdir(tmp_path)
    if case.server:
        page = serve(argv, tmp_path)
        assert "gradio" in page.lower() or page == "HTTP 401", page[:500]
        return
    code = main(argv[1:])
    out, err = capsys.readouterr()
    assert code == 0, f"{text} {case.add} exited {code}: {err[-3000:]}"
    if case.check:
        case.check(out, tmp_path)
