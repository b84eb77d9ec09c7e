"""Where a `model=` setting points: a local folder, a policy bundled with the package, or a hub id. Shared by the
backends, their rollout engines, `bapo eval` and the run's start-up checks, so none imports another for it."""
from __future__ import annotations

from pathlib import Path

POLICY_DIR = Path(__file__).resolve().parent / "policy"


def resolve_model(name: str) -> str:
    """A local path, a policy bundled in bapo_vl/policy/, or a hub id (left to from_pretrained)."""
    if Path(name).exists():
        return str(name)
    if (POLICY_DIR / name).is_dir():
        return str(POLICY_DIR / name)
    return name
