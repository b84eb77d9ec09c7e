"""The settings of a loss and the policy-loss names, without torch: bapo_vl.config reads them to check a config
before anything heavy loads. The losses themselves are in bapo_vl.losses, which registers them in POLICY_LOSSES (the
registry imports it when first read)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from bapo_vl.fields import Range, within
from bapo_vl.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

POLICY_LOSSES: Registry = Registry("policy loss", source="bapo_vl.losses")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass
class LossConfig:
    """the policy loss and its terms, as the loss functions (bapo_vl/losses.py) take them"""
    name: str = within("ppo_clip", POLICY_LOSSES, key="loss")
    """registered policy loss (see `policy_loss_names()`): ppo_clip | gspo | balanced_clip"""
    clip_low: float = 0.2
    """ε_low: the ratio's lower bound is 1 − ε_low (ppo_clip, gspo; GSPO's paper uses 3e-4)"""
    clip_high: float = 0.2
    """ε_high: the ratio's upper bound is 1 + ε_high (DAPO clip-higher: 0.28; GSPO's paper uses 4e-4)"""
    dual_clip: float | None = None
    """c of dual-clip PPO: the loss of a negative-advantage token is capped at −A·c (e.g. 3.0); None = off"""
    agg: str = within("token-mean", AGG_MODES, key="loss_agg")
    """loss aggregation: token-mean (DAPO) | seq-mean-token-mean (original GRPO) | seq-mean-token-sum"""
    kl_coef: float = within(0.001, Range(ge=0))
    """β: weight of the k3 estimate of KL(π_θ ‖ π_ref)"""
    entropy_coef: float = 0.001
    """weight of the entropy bonus (subtracted from the loss)"""
    bac_clip_low_range: tuple[float, float] = (0.6, 0.9)
    """balanced_clip: [a⁻, b⁻], range of c_low, a bound on the ratio itself (not an ε)"""
    bac_clip_high_range: tuple[float, float] = (1.2, 3.0)
    """balanced_clip: [a⁺, b⁺], range of c_high, a bound on the ratio itself"""
    bac_target: float = 0.5
    """balanced_clip: ρ0, target share pos / (pos + neg) of the positive-advantage tokens"""
    bac_step: float = 0.05
    """balanced_clip: step by which c_low, then c_high, is raised"""
    bac_dual_clip: float = 3.0
    """balanced_clip: dual-clip c for negative advantages"""
    bac_reduce: Callable[[Tensor], Tensor] | None = field(default=None, repr=False, compare=False,
                                                          metadata={"setting": False})
    """balanced_clip: sums pos/neg statistics across data-parallel ranks (see `all_reduce_sum`); None = local only.
    Set where the loss runs, not a config setting"""

    def __post_init__(self):
        if self.agg not in AGG_MODES:
            raise ValueError(f"LossConfig.agg={self.agg!r} is unknown; use one of {', '.join(AGG_MODES)}")
        self.bac_clip_low_range = tuple(float(x) for x in self.bac_clip_low_range)
        self.bac_clip_high_range = tuple(float(x) for x in self.bac_clip_high_range)
        for fname in ("bac_clip_low_range", "bac_clip_high_range"):
            lo, hi = getattr(self, fname)
            if not lo <= hi:
                raise ValueError(f"LossConfig.{fname}=({lo}, {hi}): the low end must not exceed the high end")
        if self.bac_step <= 0:
            raise ValueError(f"LossConfig.bac_step={self.bac_step} must be > 0")
        for fname in ("dual_clip", "bac_dual_clip"):
            c = getattr(self, fname)
            if c is not None and c <= 1.0:
                raise ValueError(f"LossConfig.{fname}={c} must be > 1 (3.0 is usual), or None to turn it off")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("LossConfig.clip_low / clip_high are ε values and must be >= 0 (e.g. 0.2 / 0.28)")
