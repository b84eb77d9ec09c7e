"""Which commit a figure names: a checkout's own, and an installed copy's from the URL pip installed it from."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_vl.provenance import commit

ROOT = Path(__file__).resolve().parents[1]


def git(*args, cwd=ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def checkout():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return ROOT


def test_a_checkout_names_its_own_commit(checkout):
    # Could fail if the hash were not this checkout's (or the check ran somewhere else).
    assert git("rev-parse", "HEAD").startswith(commit().removesuffix("-dirty"))


def test_a_copy_installed_from_a_git_url_names_the_commit_it_came_from(checkout, tmp_path):
    # Could fail if an installed copy (no .git beside it: a GPU machine's, a user's `pip install git+URL@REF`)
    # named no commit, so every benchmark figure it printed said "commit": null, or named another one.
    head = git("rev-parse", "HEAD")
    subprocess.run(["git", "clone", "-q", str(ROOT), str(tmp_path / "src")], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(tmp_path / "site"), f"git+file://{tmp_path / 'src'}@{head}"], check=True,
                   capture_output=True)
    assert not (tmp_path / "site" / ".git").exists()
    out = subprocess.run([sys.executable, "-c", "import bapo_vl, bapo_vl.provenance as p; "
                          "print(bapo_vl.__file__); print(p.commit())"],
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
                         capture_output=True, text=True, check=True).stdout.split()
    assert Path(out[0]).is_relative_to(tmp_path / "site")  # the installed copy, not this checkout
    assert out[1] == head[:7]
