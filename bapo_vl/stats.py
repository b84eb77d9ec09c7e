"""Statistics for comparing trained policies across training seeds and held-out prompts.

A study trains each entry (grpo, bapo, ...) with several paired seeds (seed s gives every entry the same data
order) and scores every trained policy on the same prompts, so an accuracy is noisy in two ways: which seeds were
run and which prompts were asked. The hierarchical bootstrap resamples both, seeds first and then prompts within
each drawn seed, keeping the pairing between entries. Pure numpy.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

Curve = Sequence[tuple[float, float]]  # (rollouts, value) points sorted by rollouts
CELLS_PER_CHUNK = 4_000_000  # resampled cells held in memory at once by the hierarchical bootstrap


# ---------------------------------------------------------------------------------------------------------------
# Percentile intervals
# ---------------------------------------------------------------------------------------------------------------
def percentile_interval(samples, level: float = 0.95) -> tuple[float, float]:
    """The central `level` percentile interval of `samples`, interpolated linearly (numpy's default quantile).

    Infinite samples are allowed (an unreached target counts as +inf): a quantile that touches one is infinite
    instead of the nan numpy would give.
    """
    _check_level(level)
    x = np.sort(np.asarray(samples, dtype=float).ravel())
    if x.size == 0:
        raise ValueError("percentile_interval needs at least one sample")
    if np.isnan(x).any():
        raise ValueError("percentile_interval got a nan sample")
    return _sorted_quantile(x, (1 - level) / 2), _sorted_quantile(x, (1 + level) / 2)


def _sorted_quantile(x: np.ndarray, q: float) -> float:
    """Quantile q of the sorted array x, linear between the two order statistics around (n - 1) q."""
    h = (x.size - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, x.size - 1)
    t = h - lo
    if t == 0 or x[lo] == x[hi]:
        return float(x[lo])
    if math.isinf(x[hi]):
        return math.inf
    return float(x[lo] + t * (x[hi] - x[lo]))


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level must lie strictly between 0 and 1; got {level}")


# ---------------------------------------------------------------------------------------------------------------
# Hierarchical bootstrap over seeds and prompts
# ---------------------------------------------------------------------------------------------------------------
def hierarchical_bootstrap_means(cells, n_resamples: int = 10_000, rng=0) -> np.ndarray:
    """Bootstrap distribution of the mean of `cells` (n_seeds, n_prompts): (n_resamples,) resampled means.

    Each resample draws n_seeds seeds with replacement, then for each drawn seed n_prompts prompts with
    replacement (drawn afresh for every drawn seed), and averages the drawn cells. With one seed only prompts
    vary. `rng` is an int seed or a numpy Generator; resamples are drawn in chunks of bounded memory.
    """
    x = _as_cells(cells, "cells")
    _check_resamples(n_resamples)
    rng = np.random.default_rng(rng)
    n_seeds, n_prompts = x.shape
    flat = x.ravel()
    chunk = max(1, CELLS_PER_CHUNK // x.size)
    means = np.empty(n_resamples)
    for start in range(0, n_resamples, chunk):
        r = min(chunk, n_resamples - start)
        seeds = rng.integers(0, n_seeds, size=(r, n_seeds))  # (r, S)
        prompts = rng.integers(0, n_prompts, size=(r, n_seeds, n_prompts))  # (r, S, P)
        means[start:start + r] = flat[seeds[..., None] * n_prompts + prompts].mean(axis=(1, 2))
    return means


def hierarchical_bootstrap_diff(a, b, n_resamples: int = 10_000, rng=0, level: float = 0.95) -> dict:
    """Paired difference mean(a) - mean(b) of two entries' accuracies, with its interval and p-value.

    `a` and `b` are (n_seeds, n_prompts) accuracies (counts / k); row s of both comes from training seed s and
    column j from prompt j, so resampling the per-cell difference a - b keeps both pairings: the seed and prompt
    effects shared by the two entries cancel. The p-value is the two-sided bootstrap one,
    2 min(P(d* <= 0), P(d* >= 0)) with each tail counted as (count + 1) / (n_resamples + 1), so never 0.
    """
    a = _as_cells(a, "a")
    b = _as_cells(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape (n_seeds, n_prompts); got {a.shape} and {b.shape}")
    d = a - b
    samples = hierarchical_bootstrap_means(d, n_resamples, rng)
    low, high = percentile_interval(samples, level)
    return {"diff": float(d.mean()), "low": low, "high": high, "p": bootstrap_p_value(samples),
            "n_seeds": d.shape[0], "n_prompts": d.shape[1], "resamples": n_resamples}


def hierarchical_bootstrap_mean(a, n_resamples: int = 10_000, rng=0, level: float = 0.95) -> dict:
    """One entry's mean accuracy over (n_seeds, n_prompts) cells, with its hierarchical bootstrap interval."""
    a = _as_cells(a, "a")
    samples = hierarchical_bootstrap_means(a, n_resamples, rng)
    low, high = percentile_interval(samples, level)
    return {"mean": float(a.mean()), "low": low, "high": high,
            "n_seeds": a.shape[0], "n_prompts": a.shape[1], "resamples": n_resamples}


def bootstrap_p_value(samples) -> float:
    """Two-sided p-value of "no difference" from a bootstrap distribution of differences.

    Twice the smaller tail mass at 0, each tail (count + 1) / (n + 1) so that a finite bootstrap never claims
    p = 0; capped at 1.
    """
    d = np.asarray(samples, dtype=float).ravel()
    n = d.size
    below = (np.count_nonzero(d <= 0) + 1) / (n + 1)
    above = (np.count_nonzero(d >= 0) + 1) / (n + 1)
    return float(min(1.0, 2 * min(below, above)))


def _as_cells(x, name: str) -> np.ndarray:
    """x as a finite float (n_seeds, n_prompts) array, or a ValueError saying what is wrong."""
    x = np.asarray(x, dtype=float)
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D (n_seeds, n_prompts); got shape {x.shape}")
    if x.size == 0:
        raise ValueError(f"{name} is empty: shape {x.shape}, need at least one seed and one prompt")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} has non-finite values")
    return x


def _check_resamples(n_resamples: int) -> None:
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be at least 1; got {n_resamples}")


# ---------------------------------------------------------------------------------------------------------------
# Multiple comparisons
# ---------------------------------------------------------------------------------------------------------------
def holm(pvalues: Mapping[str, float], alpha: float = 0.05) -> dict[str, dict]:
    """Holm-Bonferroni step-down correction of m p-values (controls the family-wise error rate at alpha).

    With p_(1) <= ... <= p_(m) sorted ascending, p_holm_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)), which is
    monotone in the raw p; a hypothesis is rejected when p_holm <= alpha. Returns {name: {"p", "p_holm", "reject"}}.
    """
    names = list(pvalues)
    p = np.array([pvalues[name] for name in names], dtype=float)
    if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError(f"p-values must lie in [0, 1]; got {dict(pvalues)}")
    m = p.size
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])  # (m - j + 1) p_(j) for j = 1..m
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(scaled)
    return {name: {"p": float(p[i]), "p_holm": float(adjusted[i]), "reject": bool(adjusted[i] <= alpha)}
            for i, name in enumerate(names)}


# ---------------------------------------------------------------------------------------------------------------
# Rollouts needed to reach a target
# ---------------------------------------------------------------------------------------------------------------
def rollouts_to_target(curves: Curve, target: float, log_x: bool = True) -> float | None:
    """The rollouts at which a learning curve first reaches `target` (value >= target), or None when it is not
    reached within the budget.

    `curves` is a list of (rollouts, value) points sorted by rollouts, the first the start policy (rollouts 0).
    Between the two checkpoints that bracket the first crossing the value is interpolated linearly in
    log(rollouts) when `log_x` and both are above 0 (checkpoints are spaced geometrically), else linearly in
    rollouts. A first point that already reaches the target gives its own rollouts.
    """
    points = [(float(x), float(y)) for x, y in curves]
    if not points:
        raise ValueError("rollouts_to_target needs at least one (rollouts, value) point")
    if any(x1 < x0 for (x0, _), (x1, _) in zip(points, points[1:])):
        raise ValueError(f"curve points must be sorted by rollouts; got {[x for x, _ in points]}")
    x0, y0 = points[0]
    if y0 >= target:
        return x0
    for x1, y1 in points[1:]:
        if y1 >= target:
            return _interpolate_crossing(x0, y0, x1, y1, target, log_x)
        x0, y0 = x1, y1
    return None


def _interpolate_crossing(x0: float, y0: float, x1: float, y1: float, target: float, log_x: bool) -> float:
    """The x where the segment (x0, y0) -> (x1, y1), y0 < target <= y1, meets target."""
    t = (target - y0) / (y1 - y0)
    if log_x and x0 > 0 and x1 > 0:
        return math.exp(math.log(x0) + t * (math.log(x1) - math.log(x0)))
    return x0 + t * (x1 - x0)


def rollouts_ratio_bootstrap(a_curves: Mapping[int, Curve], b_curves: Mapping[int, Curve],
                             n_resamples: int = 2000, rng=0, level: float = 0.95, log_x: bool = True) -> dict:
    """How many rollouts A needs to reach B's final mean accuracy, as a fraction of B's rollouts.

    `a_curves` and `b_curves` map each seed (the same seeds in both) to its (rollouts, mean) curve. A resample
    draws seeds with replacement, paired between A and B, and averages each entry's curves pointwise over the
    drawn seeds (rollouts too: one entry's seeds share checkpoint budgets but their rollouts differ slightly).
    B's final averaged point gives the target and the denominator; A's rollouts_to_target on its averaged curve
    is the numerator, +inf when A does not reach the target within its budget. Only seeds are resampled: the
    curves are already means over prompts, so prompt noise is not in the interval.

    Returns {"ratio": on all seeds (inf if not reached), "low", "high": percentile interval (high may be inf),
    "reached_fraction": share of resamples in which A reached the target, "n_seeds", "resamples"}.
    """
    if set(a_curves) != set(b_curves):
        raise ValueError(f"A and B must have the same seeds; got {sorted(a_curves)} and {sorted(b_curves)}")
    if not a_curves:
        raise ValueError("rollouts_ratio_bootstrap needs at least one seed")
    _check_resamples(n_resamples)
    _check_level(level)
    seeds = sorted(a_curves)
    a = _stack_curves(a_curves, seeds, "A")  # (S, K_a, 2)
    b = _stack_curves(b_curves, seeds, "B")  # (S, K_b, 2)
    if (b[:, -1, 0] <= 0).any():
        raise ValueError("B's curves must end at a positive number of rollouts (the ratio's denominator)")
    draws = np.random.default_rng(rng).integers(0, len(seeds), size=(n_resamples, len(seeds)))  # (R, S)
    ratios = np.array([_rollouts_ratio(a[d].mean(axis=0), b[d].mean(axis=0), log_x) for d in draws])
    low, high = percentile_interval(ratios, level)
    return {"ratio": _rollouts_ratio(a.mean(axis=0), b.mean(axis=0), log_x), "low": low, "high": high,
            "reached_fraction": float(np.isfinite(ratios).mean()), "n_seeds": len(seeds), "resamples": n_resamples}


def _rollouts_ratio(a_curve: np.ndarray, b_curve: np.ndarray, log_x: bool) -> float:
    """A's rollouts to reach B's final value over B's final rollouts; inf when A never reaches it."""
    b_rollouts, target = b_curve[-1]
    reached = rollouts_to_target(a_curve, target, log_x)
    return math.inf if reached is None else reached / b_rollouts


def _stack_curves(curves: Mapping[int, Curve], seeds: list[int], name: str) -> np.ndarray:
    """One entry's per-seed curves as a (n_seeds, n_checkpoints, 2) array; every seed needs the same checkpoints."""
    lengths = {seed: len(curves[seed]) for seed in seeds}
    if len(set(lengths.values())) != 1 or 0 in lengths.values():
        raise ValueError(f"{name}'s curves must have the same number of points (at least one) for every seed; "
                         f"got {lengths}")
    return np.array([[(float(x), float(y)) for x, y in curves[seed]] for seed in seeds])
