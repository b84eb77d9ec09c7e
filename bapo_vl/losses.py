"""Losses for RL with verifiable rewards: GRPO advantages, policy-loss variants, KL, entropy, aggregation.

Backend-free (torch only). Shapes: B sequences, T response tokens, V vocabulary; `mask` (B, T) is 1 on valid
response tokens and 0 on padding. Policy-loss variants live behind a registry (`@register_policy_loss`), in the
manner of verl's `core_algos`; `total_loss` puts one together with the KL and entropy terms.

Ratio convention (SPEC 2.9): ρ = exp(logp − old_logp), where `old_logp` are the STORED log-probs of whichever
policy produced the sample (α for fresh samples, π_θt for re-evaluated ones, the historical α_B for replayed ones).
For the authors' token-level truncated IS, pass the proximal (recomputed) log-probs as `old_logp` and
`is_weights=truncated_is_weights(prox_logp, behaviour_logp)` to `total_loss`.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from bapo_vl.loss_config import AGG_MODES, POLICY_LOSSES, LossConfig  # noqa: F401 (re-exported)

LOG_RATIO_CLAMP = 20.0  # |log ρ| and |log(π_ref/π)| are clamped to this before exp, for stability


# ---------------------------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------------------------
def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO advantage (paper eq. 2): A_j = (r_j − mean(r)) / sqrt(std²(r) + ε), per group.

    `rewards` (n_groups, G) -> advantages (n_groups, G). std is the unbiased one (as verl, torch.std);
    a group of one response (G == 1) has no baseline and gets 0.
    """
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))  # (n_groups, G)
    if r.shape[-1] < 2:
        return torch.zeros_like(r)
    mean = r.mean(dim=-1, keepdim=True)  # (n_groups, 1)
    std = r.std(dim=-1, keepdim=True)  # (n_groups, 1), unbiased
    return (r - mean) / torch.sqrt(std**2 + eps)


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0
                   ) -> tuple[Tensor, Tensor]:
    """GAE for BA-PPO (paper A.9: γ = λ = 1) with the outcome reward on each response's last valid token.

    rewards (B,) 0/1 outcome per response; values (B, T) = V(s_t), the critic's value before token t; mask (B, T).
    Returns (advantages, returns), both (B, T), without grad: returns = GAE + V, advantages whitened over the valid
    tokens of the batch (as verl's compute_gae_advantage_return). With γ = λ = 1, A_t = r − V(s_t) before whitening.
    """
    with torch.no_grad():
        m = mask.to(values.dtype)  # (B, T)
        last = (m.cumsum(-1) == m.sum(-1, keepdim=True)) & (m > 0)  # (B, T), the last valid token
        token_rewards = last.to(values.dtype) * rewards.to(values.dtype)[:, None]  # (B, T)
        next_value = torch.zeros_like(values[:, 0])  # (B,)
        running = torch.zeros_like(values[:, 0])  # (B,)
        out = []
        for t in reversed(range(values.shape[1])):
            delta = token_rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * running
            next_value = torch.where(m[:, t] > 0, values[:, t], next_value)  # padding passes values through
            running = torch.where(m[:, t] > 0, gae, running)
            out.append(running)
        advantages = torch.stack(out[::-1], dim=1)  # (B, T)
        returns = advantages + values
        n = m.sum()
        mean = (advantages * m).sum() / n
        var = (((advantages - mean) ** 2) * m).sum() / n * (n / (n - 1)) if n > 1 else torch.zeros_like(mean)
        return (advantages - mean) * torch.rsqrt(var + 1e-8), returns


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float, agg: str,
               n_tokens: int | float | None = None, n_seqs: int | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss 0.5·agg(max((V − R)², (clip(V, V_old ± clip) − R)²)), all (B, T); metrics vf_loss,
    vf_clipfrac (share of valid tokens where the clipped term was larger)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)  # (B, T)
    plain_sq, clipped_sq = (values - returns) ** 2, (clipped - returns) ** 2  # (B, T)
    loss = 0.5 * aggregate(torch.maximum(plain_sq, clipped_sq), mask, agg, n_tokens=n_tokens, n_seqs=n_seqs)
    frac = _masked_mean((clipped_sq > plain_sq).to(values.dtype), mask.to(values.dtype))
    return loss, _floats(vf_loss=loss, vf_clipfrac=frac)


# ---------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------------------------
# Policy-loss registry
# ---------------------------------------------------------------------------------------------------------------
PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, LossConfig], tuple[Tensor, dict[str, float | Tensor]]]
"""(logp (B,T), old_logp (B,T), adv (B,T), mask (B,T), cfg) -> (per-token loss (B,T), metrics: python floats or
detached 0-d tensors, which `total_loss` moves to the host together, in one sync)"""

register_policy_loss = POLICY_LOSSES.register
"""Decorator registering a policy loss under a name."""
get_policy_loss = POLICY_LOSSES.lookup
"""The registered policy loss `name`; an unknown name raises UnknownName (a ValueError) listing the known ones."""


MICRO_BATCH_STATISTICS = {"balanced_clip"}
"""Policy losses that take statistics over the sequences of one call (its micro-batch): which sequences share a call
changes their result, so the embedded update keeps their micro-batches in group order rather than by length."""


def policy_loss_names() -> list[str]:
    return sorted(POLICY_LOSSES)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _floats(**scalars: Tensor) -> dict[str, float]:
    """Tensors -> python floats with one device sync."""
    values = torch.stack([s.detach().float() for s in scalars.values()]).tolist()
    return dict(zip(scalars, values))


def to_host(metrics: dict) -> dict:
    """The 0-d tensors among `metrics`' values as python floats, all in one device sync; other values as they are."""
    tensors = {k: v for k, v in metrics.items() if isinstance(v, Tensor)}
    return {**metrics, **(_floats(**tensors) if tensors else {})}


def _detached(**scalars: Tensor) -> dict[str, Tensor]:
    return {k: v.detach() for k, v in scalars.items()}


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, mask: Tensor, c_low: float, c_high: float, dual_c: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO loss max(−A·ρ, −A·clip(ρ, c_low, c_high)), optionally capped at −A·c for A < 0 (dual clip).

    Bounds are on the ratio itself. clip_frac counts the valid tokens whose gradient the clip removed (either
    branch); clip_frac_dual the part due to the dual clip; ratio_max is the largest ratio of a valid token.
    """
    pg_loss1 = -adv * ratio  # (B, T)
    pg_loss2 = -adv * ratio.clamp(c_low, c_high)  # (B, T)
    loss = torch.maximum(pg_loss1, pg_loss2)  # (B, T)
    clipped = pg_loss2 > pg_loss1  # (B, T)
    dual = torch.zeros_like(clipped)
    if dual_c is not None:
        pg_loss3 = -adv * dual_c  # (B, T)
        dual = (adv < 0) & (loss > pg_loss3)
        loss = torch.where(dual, pg_loss3, loss)
    m = mask.to(ratio.dtype)
    return loss, dict(
        clip_frac=_masked_mean((clipped | dual).to(m.dtype), m),
        clip_frac_dual=_masked_mean(dual.to(m.dtype), m),
        ratio_mean=_masked_mean(ratio.detach(), m),
        # the largest over valid tokens: a few tokens far off the behaviour policy hide in the mean
        ratio_max=torch.where(m > 0, ratio.detach(), torch.zeros_like(ratio)).amax(),
    )


def _log_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    return (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)


def largest_ratio_per_row(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """(B,) the largest token ratio exp(logp − old_logp) of each row's valid tokens (0 for a row without any):
    how far the policy has moved from the one that sampled each response, where the update can see it."""
    logratio = _log_ratio(logp.detach(), old_logp)
    return torch.where(mask > 0, logratio.exp(), torch.zeros_like(logratio)).amax(-1)


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg: LossConfig):
    """Token-level PPO clip (paper eq. 1, DAPO clip-higher via ε_low ≠ ε_high), ρ = exp(logp − old_logp)."""
    logratio = _log_ratio(logp, old_logp)  # (B, T)
    loss, metrics = _clipped_surrogate(
        logratio.exp(), adv, mask, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high, cfg.dual_clip
    )
    metrics["ppo_kl"] = _masked_mean(-logratio.detach(), mask.to(logratio.dtype))
    return loss, _detached(**metrics)


@register_policy_loss("gspo")
def gspo_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg: LossConfig):
    """GSPO: sequence ratio s_i = exp(mean over valid tokens of (logp − old_logp)), clipped per sequence.

    Written in the GSPO-token form s_i,t = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)]: its value is s_i at every token, and with
    one advantage per sequence its gradient equals GSPO's. Use agg="seq-mean-token-mean" for the paper's
    per-sequence average, and set clip_low/clip_high to the paper's 3e-4/4e-4.
    """
    m = mask.to(logp.dtype)
    logratio = _log_ratio(logp, old_logp)  # (B, T)
    seq_logratio = (logratio * m).sum(-1) / m.sum(-1).clamp(min=1)  # (B,)
    log_s = (logp - logp.detach() + seq_logratio.detach().unsqueeze(-1)).clamp(max=LOG_RATIO_CLAMP)  # (B, T)
    loss, metrics = _clipped_surrogate(log_s.exp(), adv, mask, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high, None)
    metrics["ppo_kl"] = _masked_mean(-logratio.detach(), m)
    return loss, _detached(**metrics)


# ---------------------------------------------------------------------------------------------------------------
# Balanced adaptive clipping (SPEC section 6; the *other* BAPO, Xi et al. 2025)
# ---------------------------------------------------------------------------------------------------------------
def _bound_grid(lo: float, hi: float, step: float) -> list[float]:
    """lo, lo+step, ... capped at hi (the last value is exactly hi)."""
    n = math.ceil(round((hi - lo) / step, 9))
    return [round(min(lo + k * step, hi), 10) for k in range(n + 1)]


def balanced_clip_stats(ratio: Tensor, adv: Tensor, mask: Tensor, cfg: LossConfig) -> Tensor:
    """Candidate sums, computed without grad, concatenated: (neg(c_low) for each c_low, pos(c_high) for each c_high).

    neg(c) = Σ |max(ρ, c)·A⁻|, pos(c) = Σ min(ρ, c)·A⁺ over valid tokens. Sums, so they add across ranks.
    """
    c_lows = _bound_grid(*cfg.bac_clip_low_range, cfg.bac_step)
    c_highs = _bound_grid(*cfg.bac_clip_high_range, cfg.bac_step)
    with torch.no_grad():
        dtype = torch.promote_types(ratio.dtype, torch.float32)
        valid = mask > 0
        r = ratio.detach()[valid].to(dtype)  # (N,)
        a = adv.detach()[valid].to(dtype)  # (N,)
        a_pos, a_neg = a.clamp(min=0), (-a).clamp(min=0)  # (N,)
        cl = torch.tensor(c_lows, dtype=dtype, device=r.device)[:, None]  # (K_low, 1)
        ch = torch.tensor(c_highs, dtype=dtype, device=r.device)[:, None]  # (K_high, 1)
        neg = (torch.maximum(r, cl) * a_neg).sum(-1)  # (K_low,)
        pos = (torch.minimum(r, ch) * a_pos).sum(-1)  # (K_high,)
        return torch.cat([neg, pos])  # (K_low + K_high,)


def choose_balanced_bounds(stats: list[float], cfg: LossConfig) -> tuple[float, float, float]:
    """Walk c_low up from a⁻ to b⁻ (c_high = a⁺), then c_high up from a⁺ to b⁺ (c_low = b⁻), stopping at the first
    (c_low, c_high) with pos / (pos + neg) >= ρ0. Returns (c_low, c_high, share); share is 1 when pos + neg = 0."""
    c_lows = _bound_grid(*cfg.bac_clip_low_range, cfg.bac_step)
    c_highs = _bound_grid(*cfg.bac_clip_high_range, cfg.bac_step)
    neg, pos = stats[: len(c_lows)], stats[len(c_lows):]
    path = [(i, 0) for i in range(len(c_lows))] + [(len(c_lows) - 1, j) for j in range(1, len(c_highs))]
    for i, j in path:
        total = pos[j] + neg[i]
        share = pos[j] / total if total > 0 else 1.0
        if share >= cfg.bac_target:
            break
    return c_lows[i], c_highs[j], share


@register_policy_loss("balanced_clip")
def balanced_clip_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, cfg: LossConfig):
    """BAPO adaptive clipping: choose [c_low, c_high] so positive tokens keep a share ρ0 of the (clipped) objective,
    then PPO clip with those ratio bounds and dual clip c = bac_dual_clip for negative advantages.

    The bounds are chosen per call, i.e. per micro-batch: with gradient accumulation, micro-batches of one
    mini-batch may get different bounds. Under data parallelism set `cfg.bac_reduce` (e.g. `all_reduce_sum()`) so
    that pos/neg are summed over ranks and every rank picks the same bounds; the hook is called exactly once per
    call, on every rank, with a 1-D tensor of candidate sums, and must return their sum over ranks.
    """
    ratio = _log_ratio(logp, old_logp).exp()  # (B, T)
    stats = balanced_clip_stats(ratio, adv, mask, cfg)  # (K_low + K_high,)
    if cfg.bac_reduce is not None:
        stats = cfg.bac_reduce(stats)
    c_low, c_high, share = choose_balanced_bounds(stats.tolist(), cfg)
    loss, metrics = _clipped_surrogate(ratio, adv, mask, c_low, c_high, cfg.bac_dual_clip)
    return loss, {**_floats(**metrics), "bac_clip_low": c_low, "bac_clip_high": c_high, "bac_pos_share": share}


def all_reduce_sum(group=None) -> Callable[[Tensor], Tensor]:
    """A `bac_reduce` hook summing over the ranks of `group` with torch.distributed (in place, returns the tensor)."""

    def reduce(t: Tensor) -> Tensor:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
        return t

    return reduce


# ---------------------------------------------------------------------------------------------------------------
# KL, entropy, importance weights
# ---------------------------------------------------------------------------------------------------------------
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref): exp(ref − logp) − (ref − logp) − 1 >= 0. (B, T) -> (B, T)"""
    logr = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    return logr.exp() - logr - 1


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Entropy of softmax(logits): H = logsumexp(z) − Σ softmax(z)·z. (B, T, V) -> (B, T), float32 or wider.

    Rows are processed `chunk_size` at a time (in float32), so without grad the temporaries are one chunk's, never a
    full (B, T, V) softmax copy.
    """
    out_dtype = torch.promote_types(logits.dtype, torch.float32)
    flat = logits.reshape(-1, logits.shape[-1])  # (B*T, V)
    parts = []
    for z in flat.split(chunk_size):
        z = z.to(out_dtype)  # (n, V)
        z = z - z.max(dim=-1, keepdim=True).values.detach()  # H is shift-invariant; keeps lse − Σp·z exact
        lse = torch.logsumexp(z, dim=-1)  # (n,)
        p = torch.softmax(z, dim=-1)  # (n, V)
        parts.append(lse - (p * z).sum(-1))  # (n,)
    if not parts:
        return flat.new_zeros(logits.shape[:-1], dtype=out_dtype)
    return torch.cat(parts).reshape(logits.shape[:-1])  # (B, T)


def truncated_is_weights(prox_logp: Tensor, behaviour_logp: Tensor, threshold: float = 3.0) -> Tensor:
    """Token-level truncated IS weight min(π_prox / π_behaviour, threshold), detached. (B, T) -> (B, T)"""
    with torch.no_grad():
        return torch.exp((prox_logp - behaviour_logp).clamp(max=math.log(threshold)))


# ---------------------------------------------------------------------------------------------------------------
# Aggregation and the total loss
# ---------------------------------------------------------------------------------------------------------------
def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    n_tokens: int | float | None = None,
    n_seqs: int | None = None,
) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    token-mean: Σ loss·mask / n_tokens (default: mask.sum()); seq-mean-token-mean: Σ_seqs (masked token mean) / n_seqs
    (default B); seq-mean-token-sum: Σ_seqs (masked token sum) / n_seqs. With gradient accumulation pass the
    mini-batch's n_tokens / n_seqs, so that the micro-batch losses add up to the mini-batch loss.
    """
    if mode not in _AGGREGATORS:
        raise ValueError(f"unknown aggregation {mode!r}; known: {', '.join(AGG_MODES)}")
    m = mask.to(per_token.dtype)
    masked = torch.where(m > 0, per_token, torch.zeros_like(per_token)) * m  # (B, T); padding NaN/inf cannot leak
    return _AGGREGATORS[mode](masked, m, n_tokens, n_seqs)


def _token_mean(masked: Tensor, m: Tensor, n_tokens, n_seqs) -> Tensor:
    denom = m.sum().clamp(min=1) if n_tokens is None else n_tokens
    return masked.sum() / denom


def _seq_mean_token_mean(masked: Tensor, m: Tensor, n_tokens, n_seqs) -> Tensor:
    seq = masked.sum(-1) / m.sum(-1).clamp(min=1)  # (B,)
    return seq.sum() / (masked.shape[0] if n_seqs is None else n_seqs)


def _seq_mean_token_sum(masked: Tensor, m: Tensor, n_tokens, n_seqs) -> Tensor:
    return masked.sum(-1).sum() / (masked.shape[0] if n_seqs is None else n_seqs)


_AGGREGATORS = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
}
assert tuple(_AGGREGATORS) == AGG_MODES


def total_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    is_weights: Tensor | None = None,
    n_tokens: int | float | None = None,
    n_seqs: int | None = None,
    host_metrics: bool = True,
) -> tuple[Tensor, dict[str, float]]:
    """loss = agg(pg·w) + β·agg(k3) − entropy_coef·agg(H), each aggregated with cfg.agg. All inputs (B, T).

    pg comes from the registered policy loss `cfg.name`; w = is_weights (detached) if given. The KL term is added
    when ref_logp is given and β > 0, the entropy term when entropy is given. Metrics (python floats): pg_loss, kl,
    entropy, loss — the aggregated terms as they enter this call's loss (0.0 for a term not given), so with the
    mini-batch's n_tokens/n_seqs they add up over micro-batches — and the policy loss's own metrics (clip_frac,
    ratio_mean, ...), which are means over this call's valid tokens; n_valid_tokens weights those.
    host_metrics=False leaves the tensor metrics as detached 0-d tensors on the loss's device, so the call does not
    wait for the device: for a caller that gathers them over micro-batches and moves them once (`to_host`).
    """
    pg_token, metrics = get_policy_loss(cfg.name)(logp, old_logp, adv, mask, cfg)  # (B, T)
    if is_weights is not None:
        pg_token = pg_token * is_weights.detach()
    agg = lambda x: aggregate(x, mask, cfg.agg, n_tokens=n_tokens, n_seqs=n_seqs)  # noqa: E731
    pg_loss = agg(pg_token)
    loss = pg_loss
    zero = pg_loss.detach() * 0
    kl = zero
    if ref_logp is not None:
        if cfg.kl_coef > 0:
            kl = agg(kl_k3(logp, ref_logp))
            loss = loss + cfg.kl_coef * kl
        else:
            kl = agg(kl_k3(logp.detach(), ref_logp))
    ent = zero
    if entropy is not None:
        ent = agg(entropy) if cfg.entropy_coef != 0 else agg(entropy.detach())
        loss = loss - cfg.entropy_coef * ent
    metrics.update(_detached(pg_loss=pg_loss, kl=kl, entropy=ent, loss=loss, n_valid_tokens=(mask > 0).sum()))
    return loss, to_host(metrics) if host_metrics else metrics
