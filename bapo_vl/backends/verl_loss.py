"""Our Config's loss inside verl's actor.

`ppo_clip` and `gspo` are verl's own `vanilla` and `gspo` losses, configured from our Config by `actor_settings`.
`balanced_clip` has no verl counterpart: this module registers it with verl's policy-loss registry as
`bapo_balanced_clip`. verl 0.9.1 imports every `verl.plugins` entry point on `import verl`, in every process, Ray
workers included; pyproject.toml declares this module as one, so the registration happens wherever verl runs.

verl's ActorConfig is a closed dataclass, so balanced_clip's own settings (ranges, target, step, dual clip) travel
in the environment variable BAPO_VERL_LOSS (JSON), which verl_main puts in Ray's runtime_env for all workers.
"""
from __future__ import annotations

import json
import os

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from bapo_vl.losses import LossConfig, all_reduce_sum, balanced_clip_loss

ENV = "BAPO_VERL_LOSS"
VERL_LOSS_MODE = {"ppo_clip": "vanilla", "gspo": "gspo", "balanced_clip": "bapo_balanced_clip"}
NO_DUAL_CLIP = 1e9  # verl's vanilla loss always dual-clips (clip_ratio_c > 1 required); this turns it off


def actor_settings(cfg) -> dict[str, tuple[str, object]]:
    """verl config keys under actor_rollout_ref.actor that our Config decides: {key: (our field, value)}.
    verl_main refuses `verl.` overrides of them, so each setting has one place."""
    if cfg.loss not in VERL_LOSS_MODE:
        raise ValueError(f"loss={cfg.loss!r} has no verl counterpart; on verl use one of {', '.join(VERL_LOSS_MODE)}")
    return {
        "policy_loss.loss_mode": ("loss", VERL_LOSS_MODE[cfg.loss]),
        "clip_ratio_low": ("clip_low", cfg.clip_low),
        "clip_ratio_high": ("clip_high", cfg.clip_high),
        "clip_ratio_c": ("dual_clip", cfg.dual_clip if cfg.dual_clip is not None else NO_DUAL_CLIP),
        "loss_agg_mode": ("loss_agg", cfg.loss_agg),
        "use_kl_loss": ("kl_coef", cfg.kl_coef > 0),
        "kl_loss_coef": ("kl_coef", cfg.kl_coef),
        "kl_loss_type": ("kl_coef", "low_var_kl"),  # verl's name for the k3 estimator (clamped to [-10, 10])
        "entropy_coeff": ("entropy_coef", cfg.entropy_coef),
        "ppo_epochs": ("epochs", cfg.epochs),
        "ppo_mini_batch_size": ("mini_batch_size", cfg.mini_batch_size),
        "grad_clip": ("grad_clip", cfg.grad_clip),  # legacy dp_actor
        "optim.clip_grad": ("grad_clip", cfg.grad_clip),  # verl 0.9.1's engine worker clips with this one
        "optim.lr": ("lr", cfg.lr),
        "optim.weight_decay": ("weight_decay", cfg.weight_decay),
    }


def env_value(cfg) -> str:
    """BAPO_VERL_LOSS for the workers: the balanced_clip settings of cfg."""
    lc = cfg.loss_config()
    return json.dumps({k: getattr(lc, k) for k in ("bac_clip_low_range", "bac_clip_high_range", "bac_target",
                                                   "bac_step", "bac_dual_clip")})


def _dp_reduce():
    """Sum balanced-clip statistics over all ranks so every rank picks the same bounds (FSDP: ranks = DP group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return all_reduce_sum()
    return None


@register_policy_loss("bapo_balanced_clip")
def compute_policy_loss_balanced_clip(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                      config=None, rollout_is_weights=None):
    """verl's policy-loss signature over bapo_vl.losses.balanced_clip_loss, aggregated by verl's agg_loss."""
    settings = json.loads(os.environ.get(ENV) or "{}")
    cfg = LossConfig(name="balanced_clip", bac_reduce=_dp_reduce(), **settings)
    losses, metrics = balanced_clip_loss(log_prob, old_log_prob, advantages, response_mask, cfg)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    batch_info = config.global_batch_info if config is not None else {}
    pg_loss = agg_loss(loss_mat=losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch_info)
    return pg_loss, {f"actor/{k}": v for k, v in metrics.items()}
