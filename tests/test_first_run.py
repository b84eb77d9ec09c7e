"""What a first `bapo train` shows: what the default preset runs (--help), what the run learned (its last lines),
and a warning when it trains on nothing. The runs use the bundled tiny policy on CPU."""
import logging
import re
from pathlib import Path

import pytest

from bapo_vl.cli import main
from bapo_vl.train import IDLE_STEPS

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["batch_size=2", "group_size=2", "max_response_length=8", "delay=1"]


def test_help_shows_what_the_default_preset_runs(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert re.search(r"^  steps=100 +\[tiny: 60\] ", out, re.M), out
    assert re.search(r"^  batch_size=256 +\[tiny: 32\] ", out, re.M), out


def test_a_run_ends_with_what_it_learned(tmp_path, capsys):
    assert main(["train", *SMALL, "steps=5", f"run_dir={tmp_path}", "name=r", "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"learned: fresh reward \d\.\d{3} \(first 1 steps\) -> \d\.\d{3} \(last 1\); \d+ X2 "
                        r"promotions; \d+ of \d+ hard prompts \(all wrong when first drawn\) answered right later",
                        out[0]), out
    assert out[1] == f"run record: {tmp_path / 'r' / 'run.db'}"


def test_a_run_that_trains_on_nothing_says_so(tmp_path, capsys, caplog):
    """The example plugin's prompt is one the bundled countdown policy never answers: reward 0, X1/X2/X3 empty."""
    argv = ["train", "task=echo_digits", f"tasks_dirs=[{ROOT / 'examples/task_plugin'}]", "task_options={}", *SMALL,
            f"steps={IDLE_STEPS}", f"run_dir={tmp_path}", "--quiet"]
    with caplog.at_level(logging.WARNING, logger="bapo_vl.train"):
        assert main(argv) == 0
    warnings = [r.getMessage() for r in caplog.records if "trained on nothing" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"steps 1-{IDLE_STEPS} trained on nothing"), warnings


def test_readme_says_the_test_extras_change_transformers():
    text = (ROOT / "pyproject.toml").read_text()
    main_pin = re.search(r'^    "(transformers[^"]*)"', text, re.M).group(1)  # in dependencies
    test_pin = re.search(r'^test = \[.*"(transformers[^"]*)"', text, re.M).group(1)
    if main_pin != test_pin:
        assert "pin transformers < 5.11" in (ROOT / "README.md").read_text()
