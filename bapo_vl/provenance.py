"""Which code made a figure: the commit of this checkout, for reports and benchmark results."""
from __future__ import annotations

import json
import subprocess
from importlib import metadata
from pathlib import Path


def commit() -> str | None:
    """The checkout's commit (short hash, "-dirty" with uncommitted changes); for an installed copy, the commit pip
    recorded when it installed from a git URL (PEP 610's direct_url.json); otherwise None."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return installed_commit()


def installed_commit(distribution: str = "bapo-vl") -> str | None:
    """The short commit in the installed distribution's direct_url.json (`pip install git+URL@REF` writes it)."""
    try:
        text = metadata.distribution(distribution).read_text("direct_url.json")
        vcs = json.loads(text or "{}").get("vcs_info", {})
    except (metadata.PackageNotFoundError, ValueError, AttributeError):
        return None
    sha = vcs.get("commit_id") if vcs.get("vcs") == "git" else None
    return sha[:7] if isinstance(sha, str) and sha else None
