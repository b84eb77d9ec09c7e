"""Our Config's loss inside verl's actor.

`ppo_clip` and `gspo` are verl's own `vanilla` and `gspo` losses, configured from our Config by `actor_settings`.
`balanced_clip` has no verl counterpart: this module registers it with verl's policy-loss registry as
`bapo_balanced_clip`. verl 0.9.1 imports every `verl.plugins` entry point on `import verl`, in every process, Ray
workers included; pyproject.toml declares this module as one, so the registration happens wherever verl runs.
Registering is all that importing this module does.

balanced_clip's own settings (ranges, target, step, dual clip) travel in verl's config: `actor_settings` points
`policy_loss._target_` at `BalancedClipLossConfig`, verl's PolicyLossConfig with those fields, which verl's workers
build like any of its configs and hand to the loss function.

`logprobs_by_chunks` is verl's `logprobs_from_logits_v2` (the log-prob path verl takes when flash-attn's
cross-entropy kernel is absent; flash-attn is not installed) over chunks of rows: verl's version loops in Python
over the first dimension, which its FSDP engine flattens to one row per token, so a micro-batch runs one
log_softmax/gather/backward per token (read in verl 0.9.1's source); the time it saves is in docs/results.md.
`use_chunked_logprobs` puts it in place; bapo-vl's own verl worker (`verl_workers.ActorWorker`) calls it when it
starts, so only the processes of a bapo-vl run use it and other verl jobs keep verl's function.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import verl.utils.torch_functional as verl_tf
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
from verl.workers.config import PolicyLossConfig

from bapo_vl.losses import LossConfig, all_reduce_sum, balanced_clip_loss

LOGPROB_ROWS = 2048  # rows per log_softmax: bounds the transient (rows, vocab) tensor
VERL_LOSS_MODE = {"ppo_clip": "vanilla", "gspo": "gspo", "balanced_clip": "bapo_balanced_clip"}
# verl's own scheduler (per update_actor call, i.e. per training step) warms up from 0 at the first step, one step
# behind ours (bapo_vl.optim.lr_factor), and has no linear decay
VERL_LR_SCHEDULES = {"constant": "constant", "cosine": "cosine"}
NO_DUAL_CLIP = 1e9  # verl's vanilla loss always dual-clips (clip_ratio_c > 1 required); this turns it off
BALANCED_CLIP_FIELDS = ("bac_clip_low_range", "bac_clip_high_range", "bac_target", "bac_step", "bac_dual_clip")


@dataclass
class BalancedClipLossConfig(PolicyLossConfig):
    """verl's policy-loss config plus balanced_clip's settings, LossConfig's fields of that name with its defaults
    (actor_settings always sets them from our Config)."""

    bac_clip_low_range: tuple = LossConfig.bac_clip_low_range
    bac_clip_high_range: tuple = LossConfig.bac_clip_high_range
    bac_target: float = LossConfig.bac_target
    bac_step: float = LossConfig.bac_step
    bac_dual_clip: float = LossConfig.bac_dual_clip


def actor_settings(optim, loss: LossConfig) -> dict[str, tuple[str, object]]:
    """verl config keys under actor_rollout_ref.actor that our config's optim and loss groups decide:
    {key: (our field's key, value)}. verl_launch.compose refuses `verl.` overrides of them, so each setting has one
    place."""
    if loss.name not in VERL_LOSS_MODE:
        raise ValueError(f"loss={loss.name!r} has no verl counterpart; on verl use one of {', '.join(VERL_LOSS_MODE)}")
    if optim.lr_schedule not in VERL_LR_SCHEDULES:
        raise ValueError(f"lr_schedule={optim.lr_schedule!r} has no verl counterpart; on verl use one of "
                         f"{', '.join(VERL_LR_SCHEDULES)}")
    settings = {
        "policy_loss.loss_mode": ("loss", VERL_LOSS_MODE[loss.name]),
        "clip_ratio_low": ("clip_low", loss.clip_low),
        "clip_ratio_high": ("clip_high", loss.clip_high),
        "clip_ratio_c": ("dual_clip", loss.dual_clip if loss.dual_clip is not None else NO_DUAL_CLIP),
        "loss_agg_mode": ("loss_agg", loss.agg),
        "use_kl_loss": ("kl_coef", loss.kl_coef > 0),
        "kl_loss_coef": ("kl_coef", loss.kl_coef),
        "kl_loss_type": ("kl_coef", "low_var_kl"),  # verl's name for the k3 estimator (clamped to [-10, 10])
        "entropy_coeff": ("entropy_coef", loss.entropy_coef),
        "ppo_epochs": ("epochs", optim.epochs),
        "ppo_mini_batch_size": ("mini_batch_size", optim.mini_batch_size),
        "grad_clip": ("grad_clip", optim.grad_clip),  # legacy dp_actor
        "optim.clip_grad": ("grad_clip", optim.grad_clip),  # verl 0.9.1's engine worker clips with this one
        "optim.lr": ("lr", optim.lr),
        "optim.lr_scheduler_type": ("lr_schedule", VERL_LR_SCHEDULES[optim.lr_schedule]),
        "optim.lr_warmup_steps": ("lr_warmup_steps", optim.lr_warmup_steps),
        "optim.min_lr_ratio": ("min_lr_ratio", optim.min_lr_ratio),
        "optim.weight_decay": ("weight_decay", optim.weight_decay),
    }
    if loss.name == "balanced_clip":
        settings["policy_loss._target_"] = ("loss", f"{__name__}.{BalancedClipLossConfig.__name__}")
        settings |= {f"policy_loss.{k}": (k, list(v) if isinstance(v, tuple) else v)
                     for k in BALANCED_CLIP_FIELDS for v in [getattr(loss, k)]}
    return settings


def _dp_reduce():
    """Sum balanced-clip statistics over all ranks so every rank picks the same bounds (FSDP: ranks = DP group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return all_reduce_sum()
    return None


@register_policy_loss("bapo_balanced_clip")
def compute_policy_loss_balanced_clip(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                      config=None, rollout_is_weights=None):
    """verl's policy-loss signature over bapo_vl.losses.balanced_clip_loss, aggregated by verl's agg_loss; its
    settings come from the actor config's policy_loss (a BalancedClipLossConfig)."""
    policy_loss = getattr(config, "policy_loss", None)
    if not isinstance(policy_loss, BalancedClipLossConfig):
        raise ValueError(f"loss mode bapo_balanced_clip needs actor_rollout_ref.actor.policy_loss._target_="
                         f"{__name__}.{BalancedClipLossConfig.__name__} (bapo-vl's verl launcher sets it)")
    settings = {k: getattr(policy_loss, k) for k in BALANCED_CLIP_FIELDS}
    settings = {k: tuple(v) if k.endswith("_range") else v for k, v in settings.items()}
    cfg = LossConfig(name="balanced_clip", bac_reduce=_dp_reduce(), **settings)
    losses, metrics = balanced_clip_loss(log_prob, old_log_prob, advantages, response_mask, cfg)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    batch_info = config.global_batch_info if config is not None else {}
    pg_loss = agg_loss(loss_mat=losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch_info)
    # verl averages a metric over micro-batches: a largest ratio would come out as a mean of maxima, so it stays out
    return pg_loss, {f"actor/{k}": v for k, v in metrics.items() if k != "ratio_max"}


def logprobs_by_chunks(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl's `logprobs_from_logits_v2` (log-probs of `labels` under `logits` (..., V), per row of the first
    dimension: x_label - logsumexp(x) in float32/64, log_softmax then gather in bf16), over LOGPROB_ROWS rows at a
    time instead of one."""
    out = []
    for x, y in zip(logits.split(LOGPROB_ROWS), labels.split(LOGPROB_ROWS)):
        if x.dtype in (torch.float32, torch.float64):
            out.append(x.gather(-1, y.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1))
        else:  # verl: logsumexp is unstable in bf16
            out.append(torch.log_softmax(x, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1))
    return torch.cat(out) if out else logits.new_zeros(labels.shape)


verl_row_loop = verl_tf.logprobs_from_logits_v2  # verl's own (the tests compare against it)


def use_chunked_logprobs():
    """Put logprobs_by_chunks where verl's logprobs_from_logits looks for the path without flash-attn, in this
    process (bapo-vl's verl worker calls it as it starts)."""
    verl_tf.logprobs_from_logits_v2 = logprobs_by_chunks
