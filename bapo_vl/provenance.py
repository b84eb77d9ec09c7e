"""Which code made a figure: the commit of this checkout, for reports and benchmark results."""
from __future__ import annotations

import subprocess
from pathlib import Path


def commit() -> str | None:
    """The checkout's commit (short hash, "-dirty" with uncommitted changes); None outside a git checkout."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
