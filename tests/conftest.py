import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture
def shared_data() -> Path:
    """The real datasets beside the checkout (../shared/data); tests that need them skip without it."""
    if not (SHARED / "data").is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED / "data"
