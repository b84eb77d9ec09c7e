"""Tests of bapo_vl.stats: the hierarchical bootstrap against its distribution enumerated by hand, the pairing,
Holm against a worked example, and rollouts-to-target on hand-computed curves (arithmetic in the comments)."""
import itertools
import math
import time

import numpy as np
import pytest

from bapo_vl.stats import (
    bootstrap_p_value,
    hierarchical_bootstrap_diff,
    hierarchical_bootstrap_mean,
    hierarchical_bootstrap_means,
    holm,
    percentile_interval,
    rollouts_ratio_bootstrap,
    rollouts_to_target,
)


# ---------------------------------------------------------------------------------------------------------------
# Hierarchical bootstrap
# ---------------------------------------------------------------------------------------------------------------
def enumerated_means(d: np.ndarray) -> np.ndarray:
    """Every equally likely outcome of one hierarchical resample of d (S, P): S seed draws, then P prompt draws
    for each drawn seed; the resampled mean of each outcome."""
    n_seeds, n_prompts = d.shape
    means = []
    for seeds in itertools.product(range(n_seeds), repeat=n_seeds):
        for prompts in itertools.product(range(n_prompts), repeat=n_seeds * n_prompts):
            rows = np.repeat(seeds, n_prompts)
            means.append(d[rows, prompts].mean())
    return np.array(means)


def test_bootstrap_matches_the_enumerated_distribution():
    # d = a - b = [[0.25, 0.0], [0.75, -0.25]]: 4 seed draws x 4 x 4 prompt draws = 64 equally likely outcomes.
    # Quarters and their sums are exact in binary, so the resampled means are exact multiples of 1/16 and the
    # bootstrap's atoms can be compared with the enumerated ones by equality.
    a = np.array([[0.75, 0.5], [1.0, 0.25]])
    b = np.array([[0.5, 0.5], [0.25, 0.5]])
    d = a - b
    exact = enumerated_means(d)
    assert exact.size == 64
    assert exact.mean() == pytest.approx(d.mean())  # the resampled mean is unbiased in a balanced design

    n = 200_000
    samples = hierarchical_bootstrap_means(d, n_resamples=n, rng=0)
    assert samples.mean() == pytest.approx(exact.mean(), abs=4 * exact.std() / math.sqrt(n))
    atoms, counts = np.unique(exact, return_counts=True)
    got_atoms, got_counts = np.unique(samples, return_counts=True)
    assert set(got_atoms) <= set(atoms)
    for atom, count in zip(atoms, counts):
        p = count / exact.size
        freq = np.count_nonzero(samples == atom) / n
        assert freq == pytest.approx(p, abs=5 * math.sqrt(p * (1 - p) / n)), atom

    # q = 0.025 and 0.975 sit at 1.6/64 and 62.4/64, inside steps of the CDF (its jumps are at k/64), so the
    # bootstrap's percentiles land on the enumerated distribution's atoms there.
    out = hierarchical_bootstrap_diff(a, b, n_resamples=n, rng=0)
    assert out["diff"] == pytest.approx(0.1875)  # (0.25 + 0 + 0.75 - 0.25) / 4
    assert out["low"] == np.quantile(exact, 0.025, method="inverted_cdf")
    assert out["high"] == np.quantile(exact, 0.975, method="inverted_cdf")
    assert out["low"] < out["diff"] < out["high"]
    assert (out["n_seeds"], out["n_prompts"], out["resamples"]) == (2, 2, n)


def test_constant_difference_gives_a_point_interval_and_tiny_p():
    # a = b + 0.1 in every cell: every resample's mean difference is 0.1, so the interval is [0.1, 0.1], and no
    # resample is <= 0, so p = 2 (0 + 1) / (n + 1).
    rng = np.random.default_rng(1)
    b = rng.uniform(0, 0.8, size=(3, 50))
    out = hierarchical_bootstrap_diff(b + 0.1, b, n_resamples=999, rng=0)
    assert out["diff"] == pytest.approx(0.1)
    assert out["low"] == pytest.approx(0.1) and out["high"] == pytest.approx(0.1)
    assert out["p"] == pytest.approx(2 / 1000)


def test_equal_entries_give_p_one():
    b = np.random.default_rng(2).uniform(size=(3, 20))
    out = hierarchical_bootstrap_diff(b, b, n_resamples=500)
    assert out["diff"] == 0 and out["low"] == 0 and out["high"] == 0 and out["p"] == 1


def test_swapping_entries_negates_the_interval():
    rng = np.random.default_rng(3)
    a, b = rng.uniform(size=(4, 30)), rng.uniform(size=(4, 30))
    ab = hierarchical_bootstrap_diff(a, b, n_resamples=2000, rng=7)
    ba = hierarchical_bootstrap_diff(b, a, n_resamples=2000, rng=7)
    assert ba["diff"] == pytest.approx(-ab["diff"])
    assert ba["low"] == pytest.approx(-ab["high"]) and ba["high"] == pytest.approx(-ab["low"])
    assert ba["p"] == pytest.approx(ab["p"])


def test_seeds_are_resampled():
    # Every prompt of seed 0 differs by 0 and every prompt of seed 1 by 0.2: prompts cannot move a resample,
    # the two seed draws give means 0, 0.1 (twice) or 0.2 with probabilities 1/4, 1/2, 1/4, so the 95% interval
    # is [0, 0.2]. A bootstrap over prompts alone would give [0.1, 0.1].
    d = np.repeat([[0.0], [0.2]], 40, axis=1)
    out = hierarchical_bootstrap_diff(d, np.zeros_like(d), n_resamples=4000, rng=0)
    assert out["diff"] == pytest.approx(0.1)
    assert out["low"] == pytest.approx(0.0) and out["high"] == pytest.approx(0.2)


def test_pairing_cancels_seed_and_prompt_effects():
    # Seeds and prompts move both entries by up to +-0.4, but A - B = 0.05 + noise of sd 0.01 in every cell:
    # the paired interval is a few thousandths wide around 0.05, resampling A and B independently is not.
    rng = np.random.default_rng(4)
    seed_effect = rng.uniform(-0.4, 0.4, size=(5, 1))
    prompt_effect = rng.uniform(-0.4, 0.4, size=(1, 200))
    b = 0.5 + seed_effect + prompt_effect
    a = b + 0.05 + rng.normal(0, 0.01, size=b.shape)
    paired = hierarchical_bootstrap_diff(a, b, n_resamples=4000, rng=0)
    unpaired = hierarchical_bootstrap_means(a, 4000, rng=1) - hierarchical_bootstrap_means(b, 4000, rng=2)
    unpaired_low, unpaired_high = percentile_interval(unpaired, 0.95)
    assert paired["low"] < 0.05 < paired["high"]
    assert paired["high"] - paired["low"] < 0.01
    assert paired["high"] - paired["low"] < 0.1 * (unpaired_high - unpaired_low)
    assert paired["p"] == pytest.approx(2 / 4001)


def test_one_seed_resamples_prompts_only():
    # One seed: the interval is the prompt bootstrap's, close to mean +- 1.96 sd / sqrt(P).
    rng = np.random.default_rng(5)
    a = rng.integers(0, 9, size=(1, 400)) / 8  # counts of 8 samples
    out = hierarchical_bootstrap_mean(a, n_resamples=10_000, rng=0)
    half_width = 1.96 * a.std() / math.sqrt(a.size)
    assert out["mean"] == pytest.approx(a.mean())
    assert out["low"] == pytest.approx(a.mean() - half_width, abs=0.1 * half_width)
    assert out["high"] == pytest.approx(a.mean() + half_width, abs=0.1 * half_width)
    assert out["n_seeds"] == 1 and "p" not in out and "diff" not in out


def test_bootstrap_is_reproducible():
    rng = np.random.default_rng(6)
    a, b = rng.uniform(size=(3, 40)), rng.uniform(size=(3, 40))
    first = hierarchical_bootstrap_diff(a, b, n_resamples=500, rng=11)
    assert hierarchical_bootstrap_diff(a, b, n_resamples=500, rng=11) == first
    assert hierarchical_bootstrap_diff(a, b, n_resamples=500, rng=np.random.default_rng(11)) == first
    assert hierarchical_bootstrap_diff(a, b, n_resamples=500, rng=12) != first


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"same shape.*\(2, 3\) and \(2, 4\)"):
        hierarchical_bootstrap_diff(np.zeros((2, 3)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="empty"):
        hierarchical_bootstrap_diff(np.zeros((0, 3)), np.zeros((0, 3)))
    with pytest.raises(ValueError, match="empty"):
        hierarchical_bootstrap_mean(np.zeros((2, 0)))
    with pytest.raises(ValueError, match="2-D"):
        hierarchical_bootstrap_mean(np.zeros(5))
    with pytest.raises(ValueError, match="non-finite"):
        hierarchical_bootstrap_mean([[0.5, np.nan]])


def test_bootstrap_speed():
    rng = np.random.default_rng(7)
    a, b = rng.uniform(size=(5, 768)), rng.uniform(size=(5, 768))
    start = time.perf_counter()
    hierarchical_bootstrap_diff(a, b, n_resamples=10_000)
    assert time.perf_counter() - start < 5


def test_p_value_counts_both_tails():
    # 3 of 9 samples <= 0 and 7 of 9 >= 0 (the 0 counts in both): p = 2 (3 + 1) / 10 = 0.8.
    assert bootstrap_p_value([-2, -1, 0, 1, 2, 3, 4, 5, 6]) == pytest.approx(0.8)


def test_percentile_interval_with_infinities():
    # linear quantiles of [1, 2, 3, inf] at 0.025 and 0.975 sit at positions 0.075 and 2.925: 1.075 and inf.
    low, high = percentile_interval([3, 1, math.inf, 2], 0.95)
    assert low == pytest.approx(1.075) and high == math.inf
    assert percentile_interval(np.arange(101.0), 0.9) == pytest.approx((5.0, 95.0))
    assert percentile_interval([math.inf, math.inf], 0.95) == (math.inf, math.inf)
    with pytest.raises(ValueError, match="level"):
        percentile_interval([1.0], 1.0)


# ---------------------------------------------------------------------------------------------------------------
# Holm
# ---------------------------------------------------------------------------------------------------------------
def test_holm_worked_example():
    # m = 4, sorted: d 0.005, a 0.01, c 0.03, b 0.04, scaled by 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04;
    # running max: 0.02, 0.03, 0.06, 0.06. At alpha = 0.05 d and a are rejected, c and b are not.
    out = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    assert {k: v["p_holm"] for k, v in out.items()} == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06, "d": 0.02})
    assert {k: v["reject"] for k, v in out.items()} == {"a": True, "b": False, "c": False, "d": True}
    assert out["c"]["p"] == 0.03


def test_holm_caps_at_one_and_keeps_ties_equal():
    # the two 0.02s get 3 x 0.02 = 0.06 and max(0.06, 2 x 0.02) = 0.06; 0.5 gets max(0.06, 1 x 0.5) = 0.5.
    out = holm({"x": 0.5, "y": 0.02, "z": 0.02})
    assert out["y"]["p_holm"] == out["z"]["p_holm"] == pytest.approx(0.06)
    assert out["x"]["p_holm"] == pytest.approx(0.5)
    # 2 x 0.6 = 1.2 -> 1, and max(1, 1 x 0.7) = 1.
    out = holm({"x": 0.6, "y": 0.7})
    assert out["x"]["p_holm"] == 1.0 and out["y"]["p_holm"] == 1.0
    assert holm({}) == {}
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        holm({"x": 1.5})


def test_holm_is_monotone_and_agrees_with_the_step_down_procedure():
    rng = np.random.default_rng(8)
    for _ in range(50):
        p = {f"h{i}": float(v) for i, v in enumerate(rng.uniform(0, 0.1, size=rng.integers(1, 8)))}
        out = holm(p)
        by_p = sorted(p, key=p.get)
        adjusted = [out[name]["p_holm"] for name in by_p]
        assert adjusted == sorted(adjusted)
        assert all(p[name] <= out[name]["p_holm"] <= 1 for name in p)
        for alpha in (0.01, 0.05, 0.1):
            # reject p_(1), p_(2), ... while p_(i) <= alpha / (m - i + 1), stop at the first that is not
            m, rejected = len(p), set()
            for i, name in enumerate(by_p):
                if p[name] > alpha / (m - i):
                    break
                rejected.add(name)
            assert {k for k, v in holm(p, alpha).items() if v["reject"]} == rejected


# ---------------------------------------------------------------------------------------------------------------
# Rollouts to target
# ---------------------------------------------------------------------------------------------------------------
def test_rollouts_to_target_interpolates_in_log_rollouts():
    # 0.6 is halfway from 0.5 to 0.7, so halfway from log 1000 to log 4000: sqrt(1000 x 4000) = 2000.
    curve = [(0, 0.3), (1000, 0.5), (4000, 0.7)]
    assert rollouts_to_target(curve, 0.6) == pytest.approx(2000)
    # linear in rollouts instead: 1000 + 0.5 x 3000 = 2500
    assert rollouts_to_target(curve, 0.6, log_x=False) == pytest.approx(2500)


def test_rollouts_to_target_from_zero_is_linear():
    # log 0 is undefined: 0.4 is a quarter of the way from 0.3 to 0.7, so a quarter of 1000 = 250.
    assert rollouts_to_target([(0, 0.3), (1000, 0.7)], 0.4) == pytest.approx(250)


def test_rollouts_to_target_edges():
    assert rollouts_to_target([(0, 0.3), (1000, 0.5), (4000, 0.55)], 0.6) is None  # not reached within the budget
    assert rollouts_to_target([(0, 0.65), (1000, 0.7)], 0.6) == 0  # the start policy already reaches it
    assert rollouts_to_target([(0, 0.3), (1000, 0.5), (4000, 0.6)], 0.6) == pytest.approx(4000)  # met exactly
    # the first crossing counts, not a later one: 0.6 is 5/6 of the way from 0.1 to 0.7, so 833.3 rollouts
    assert rollouts_to_target([(0, 0.1), (1000, 0.7), (2000, 0.4), (4000, 0.9)], 0.6) == pytest.approx(2500 / 3)
    with pytest.raises(ValueError, match="sorted"):
        rollouts_to_target([(1000, 0.3), (0, 0.5)], 0.4)
    with pytest.raises(ValueError, match="at least one"):
        rollouts_to_target([], 0.4)


def jittered(xs, ys, seed):
    """One seed's curve: rollouts a little off the budgets (1% per seed), values shifted by 0.03 per seed."""
    return [(x * (1 + 0.01 * seed), y + 0.03 * seed) for x, y in zip(xs, ys)]


B_X = [0, 1000, 2000, 4000, 8000]
B_Y = [0.2, 0.35, 0.45, 0.52, 0.56]


def test_ratio_of_identical_entries_is_one():
    b = {s: jittered(B_X, B_Y, s) for s in range(3)}
    out = rollouts_ratio_bootstrap(b, dict(b), n_resamples=500)
    assert out["ratio"] == pytest.approx(1.0)
    assert out["low"] == pytest.approx(1.0) and out["high"] == pytest.approx(1.0)
    assert out["reached_fraction"] == 1.0 and out["n_seeds"] == 3


def test_ratio_of_an_entry_twice_as_fast_is_one_half():
    # A's seed s is B's seed s at half the rollouts and goes on to 0.6: in every resample A's averaged curve
    # passes B's final averaged mean at half B's final averaged rollouts.
    b = {s: jittered(B_X, B_Y, s) for s in range(3)}
    a = {s: jittered([0, 500, 1000, 2000, 4000, 8000], B_Y + [0.6], s) for s in range(3)}
    out = rollouts_ratio_bootstrap(a, b, n_resamples=500)
    assert out["ratio"] == pytest.approx(0.5)
    assert out["low"] == pytest.approx(0.5) and out["high"] == pytest.approx(0.5)


def test_ratio_interpolates_between_checkpoints():
    # B ends at 0.6 after 4000 rollouts; A passes 0.6 halfway (in log) from (1000, 0.5) to (4000, 0.7): 2000,
    # so the ratio is 2000 / 4000 = 0.5.
    a = {0: [(0, 0.2), (1000, 0.5), (4000, 0.7)]}
    b = {0: [(0, 0.2), (1000, 0.4), (4000, 0.6)]}
    out = rollouts_ratio_bootstrap(a, b, n_resamples=100)
    assert out["ratio"] == pytest.approx(0.5) and out["low"] == pytest.approx(0.5)


def test_ratio_when_a_never_reaches_is_infinite():
    b = {s: jittered(B_X, B_Y, s) for s in range(3)}
    a = {s: jittered(B_X, [y - 0.1 for y in B_Y], s) for s in range(3)}
    out = rollouts_ratio_bootstrap(a, b, n_resamples=500)
    assert out["ratio"] == math.inf and out["low"] == math.inf and out["high"] == math.inf
    assert out["reached_fraction"] == 0.0


def test_ratio_when_some_resamples_reach():
    # B ends at 0.5 after 1000 rollouts on both seeds; A ends at 0.8 on seed 0 and 0.3 on seed 1.
    # Draws (0, 0): A averages 0.8, reaches 0.5 at 1000 x 0.3 / 0.6 = 500 (linear from 0): ratio 0.5, prob 1/4.
    # Draws (0, 1), (1, 0): A averages 0.55, ratio 0.3 / 0.35 = 0.857, prob 1/2 (also the all-seed estimate).
    # Draws (1, 1): A ends at 0.3, never reaches: inf, prob 1/4. So reached 3/4, interval [0.5, inf].
    b = {0: [(0, 0.2), (1000, 0.5)], 1: [(0, 0.2), (1000, 0.5)]}
    a = {0: [(0, 0.2), (1000, 0.8)], 1: [(0, 0.2), (1000, 0.3)]}
    out = rollouts_ratio_bootstrap(a, b, n_resamples=2000, rng=0)
    assert out["ratio"] == pytest.approx(0.3 / 0.35)
    assert out["low"] == pytest.approx(0.5) and out["high"] == math.inf
    assert out["reached_fraction"] == pytest.approx(0.75, abs=5 * math.sqrt(0.75 * 0.25 / 2000))


def test_ratio_refuses_mismatched_inputs():
    b = {s: jittered(B_X, B_Y, s) for s in range(2)}
    with pytest.raises(ValueError, match="same seeds"):
        rollouts_ratio_bootstrap({0: b[0]}, b)
    with pytest.raises(ValueError, match="same number of points"):
        rollouts_ratio_bootstrap({0: b[0], 1: b[1][:3]}, b)
