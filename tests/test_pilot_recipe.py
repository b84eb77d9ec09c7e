"""scripts/pilot_recipe.py: the pilot's rule that picks the study's recipe."""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("pilot_recipe", Path(__file__).parents[1] / "scripts" / "pilot_recipe.py")
pilot_recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pilot_recipe)


def row(entry, budget, mean, greedy):
    return {"entry": entry, "budget": budget, "mean@k": mean, "greedy": greedy}


START = row("start", 0, 0.50, 0.60)


def test_the_largest_rise_with_greedy_not_lower_wins():
    # Could fail if greedy were ignored (lr1e-4 rises most but loses greedy) or an earlier checkpoint counted.
    rows = [START, row("lr1e-4_kl0_mb16", 100, 0.60, 0.55), row("lr3e-5_kl1e-3_mb64", 100, 0.54, 0.60),
            row("lr1e-5_kl0_mb64", 100, 0.535, 0.61), row("lr1e-5_kl0_mb64", 50, 0.70, 0.70)]
    choice = pilot_recipe.choose(rows)
    assert choice["overrides"] == "lr=3e-5 kl_coef=1e-3 mini_batch_size=64"
    assert choice["qualified"] == ["lr3e-5_kl1e-3_mb64", "lr1e-5_kl0_mb64"]


def test_without_a_qualifying_setting_the_largest_rise_is_taken():
    rows = [START, row("lr1e-4_kl0_mb16", 100, 0.52, 0.55), row("lr1e-5_kl0_mb64", 100, 0.51, 0.60)]
    choice = pilot_recipe.choose(rows)
    assert choice["entry"] == "lr1e-4_kl0_mb16" and choice["qualified"] == []
    with pytest.raises(ValueError, match="no pilot entry"):
        pilot_recipe.choose([START, row("grpo", 100, 0.6, 0.6)])
