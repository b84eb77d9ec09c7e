import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

SHARED = Path(__file__).resolve().parents[2] / "shared"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# BAPO_TEST_NO_SHARED=1 makes the fixtures below ignore ../shared, to run as on a clone that lacks it.
NO_SHARED = os.environ.get("BAPO_TEST_NO_SHARED") == "1"


def _shared(*parts: str) -> Path | None:
    path = SHARED.joinpath("data", *parts)
    return path if path.is_dir() and not NO_SHARED else None


@pytest.fixture
def shared_data() -> Path:
    """The real datasets beside the checkout (../shared/data); tests that need them skip without it."""
    data = _shared()
    if data is None:
        pytest.skip("../shared/data is not present")
    return data


@pytest.fixture
def geometry3k_source() -> str:
    """Geometry3K in the Inter-GPS layout: ../shared/data/geometry3k, else the bundled 3-problem train split
    (so use split "train", the one both have)."""
    return str(_shared("geometry3k") or FIXTURES / "geometry3k")


@pytest.fixture
def math_eval_source() -> str:
    """The math eval sets in the Qwen2.5-Math layout (all five splits): ../shared/data/math/qwen_eval, else the
    bundled 2-3 rows of each."""
    return str(_shared("math", "qwen_eval") or FIXTURES / "math" / "qwen_eval")
