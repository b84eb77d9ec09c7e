"""A run name is a plain folder name under run_dir: one that walks out of it, holds a path separator or is longer
than a file system takes is refused at start with one line (exit code 2), before anything is written."""
import pytest

from bapo_vl.cli import main
from bapo_vl.config import Config, ConfigError


@pytest.mark.parametrize("name", ["../../escape", "/tmp/escape", "a/b", "a\\b", "..", "."])
def test_a_name_that_is_not_a_plain_folder_name_is_refused(tmp_path, capsys, name):
    # Could fail as it did: name=../../escape wrote its run two folders above run_dir.
    runs = tmp_path / "a" / "b" / "runs"
    assert main(["train", f"run_dir={runs}", f"name={name}", "steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"bapo: name={name!r}: a run name ") and "\n" not in err, err
    assert list(tmp_path.rglob("*")) == [] and not (tmp_path.parent / "escape").exists()  # nothing written anywhere


def test_a_name_too_long_for_a_folder_is_refused_in_one_short_line(tmp_path, capsys):
    # Could fail as it did: a 5,000-character name ended in an OSError (File name too long) once the run began,
    # and the line would echo all 5,000 characters.
    assert main(["train", f"run_dir={tmp_path}", f"name={'x' * 5000}", "steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bapo: name='xxxx")
    assert "(5,000 characters): a run name is a folder name, at most 255 bytes" in err
    assert "\n" not in err and len(err) < 200 and "OSError" not in err
    assert list(tmp_path.iterdir()) == []


def test_plain_names_pass_the_same_check_in_python():
    assert Config.from_dict(dict(name="bapo-countdown_2024.v2 (seed 1)")).run.name == "bapo-countdown_2024.v2 (seed 1)"
    assert Config.from_dict(dict(name="é" * 127)).run.name  # 254 bytes
    with pytest.raises(ConfigError, match="at most 255 bytes"):
        Config.from_dict(dict(name="é" * 128))  # 256 bytes in UTF-8: the limit is the file system's, in bytes
    with pytest.raises(ConfigError, match="plain folder name"):
        Config.from_dict(dict(name="../x"))
    with pytest.raises(ConfigError, match="no control characters"):
        Config.from_dict(dict(name="two\nlines"))  # a newline would split every one-line message that names the run
