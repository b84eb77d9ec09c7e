"""Tests of bapo_vl.losses: hand-computed numbers (arithmetic in the comments) and verl's own GRPO advantage."""
import math

import numpy as np
import pytest
import torch

from bapo_vl.losses import (
    LossConfig,
    aggregate,
    balanced_clip_stats,
    entropy_from_logits,
    get_policy_loss,
    grpo_advantages,
    kl_k3,
    policy_loss_names,
    register_policy_loss,
    to_host,
    total_loss,
    truncated_is_weights,
)

T = torch.tensor


def logps_from_ratios(ratios, old_prob=0.2):
    """old_logp = log(old_prob) everywhere; logp = old_logp + log ρ (a leaf that requires grad)."""
    ratios = T(ratios, dtype=torch.float64)
    old = torch.full_like(ratios, math.log(old_prob))
    logp = (old + ratios.log()).requires_grad_()
    return logp, old


# ---------------------------------------------------------------------------------------------------------------
# grpo_advantages
# ---------------------------------------------------------------------------------------------------------------
def test_grpo_advantages_by_hand():
    adv = grpo_advantages(T([[1.0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]]), eps=1e-6)
    # [1,0,0,0]: mean 0.25; squared deviations 0.5625 + 3·0.0625 = 0.75; unbiased var 0.75/3 = 0.25, std 0.5
    #   -> 0.75/0.5 = 1.5 and -0.25/0.5 = -0.5 (the ε=1e-6 moves these by ~2e-6)
    # [1,1,1,1]: every deviation is 0 -> 0
    # [1,0,1,0]: mean 0.5; squared deviations 4·0.25 = 1; var 1/3, std 0.57735 -> ±0.5/0.57735 = ±0.866025
    s = 0.5 / math.sqrt(1 / 3)
    expected = T([[1.5, -0.5, -0.5, -0.5], [0, 0, 0, 0], [s, -s, s, -s]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_grpo_advantages_all_equal_and_single():
    assert torch.equal(grpo_advantages(T([[0.0] * 8, [1.0] * 8])), torch.zeros(2, 8))
    # G == 1: the unbiased std is undefined (torch gives nan); a lone response has no baseline -> 0
    assert torch.equal(grpo_advantages(T([[1.0], [0.0]])), torch.zeros(2, 1))
    # integer rewards are accepted and give floats
    assert grpo_advantages(T([[1, 0]])).dtype == torch.float32


def test_grpo_advantages_match_verl():
    """Against verl's real compute_grpo_outcome_advantage on shuffled groups with ragged responses.

    verl divides by (std + ε), we by sqrt(std² + ε). With ε = 1e-6 and 0/1 rewards, the smallest nonzero std of a
    group of 8 is sqrt(7/8 · 1/7)... = 0.354 (one correct of 8), so the two denominators differ by about
    ε/s + ε/(2s²) ≈ 7e-6 relative: far below the 1e-4 tolerance. (A large ε such as 1e-2 would not agree.)
    """
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    g = torch.Generator().manual_seed(0)
    n_groups, G, Tmax = 12, 8, 7
    p = torch.rand(n_groups, 1, generator=g)
    rewards = (torch.rand(n_groups, G, generator=g) < p).float()  # (n_groups, G)
    rewards[0] = 0.0  # an all-wrong group
    rewards[1] = 1.0  # an all-right group
    rewards[2] = T([1.0, 0, 0, 0, 0, 0, 0, 0])  # the smallest std
    ours = grpo_advantages(rewards, eps=1e-6)  # (n_groups, G)

    perm = torch.randperm(n_groups * G, generator=g)  # verl groups by uid, not by position
    flat_r, flat_ours = rewards.reshape(-1)[perm], ours.reshape(-1)[perm]
    uids = np.array([f"uid-{int(i) // G}" for i in perm], dtype=object)
    lengths = torch.randint(1, Tmax + 1, (n_groups * G,), generator=g)
    response_mask = (torch.arange(Tmax)[None, :] < lengths[:, None]).float()  # right-padded
    token_level_rewards = torch.zeros(n_groups * G, Tmax)
    token_level_rewards[torch.arange(n_groups * G), lengths - 1] = flat_r  # reward at the last valid token

    verl_adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index=uids, epsilon=1e-6, norm_adv_by_std_in_grpo=True
    )
    torch.testing.assert_close(verl_adv, flat_ours[:, None] * response_mask, atol=1e-4, rtol=0)
    assert ours.abs().max() > 1.0  # not trivially all zeros


# ---------------------------------------------------------------------------------------------------------------
# ppo_clip
# ---------------------------------------------------------------------------------------------------------------
def test_ppo_clip_by_hand_with_grad_mask_and_clip_frac():
    # seq 0: A = +1, ρ = [1.0, 1.5, 0.5, (masked)]; seq 1: A = -1, ρ = [1.0, 1.5, 0.5, 4.0]; ε = 0.2 -> [0.8, 1.2]
    logp, old = logps_from_ratios([[1.0, 1.5, 0.5, 1.0], [1.0, 1.5, 0.5, 4.0]])
    old = old.clone()
    old[0, 3] = -100.0  # garbage behaviour log-prob on padding: log ρ = 100 -> clamped to 20, still masked out
    adv = T([[1.0] * 4, [-1.0] * 4], dtype=torch.float64)
    mask = T([[1, 1, 1, 0], [1, 1, 1, 1]])
    loss, m = get_policy_loss("ppo_clip")(logp, old, adv, mask, LossConfig())
    # A = +1: loss = -min(ρ, clip(ρ)):  ρ=1 -> -1;  ρ=1.5 -> -min(1.5, 1.2) = -1.2 (clipped);  ρ=0.5 -> -0.5
    # A = -1: loss = max(ρ, clip(ρ)):   ρ=1 -> 1;   ρ=1.5 -> max(1.5, 1.2) = 1.5;  ρ=0.5 -> max(0.5, 0.8) = 0.8
    #         (clipped);  ρ=4 -> max(4, 1.2) = 4 (no dual clip by default)
    expected = T([[-1.0, -1.2, -0.5], [1.0, 1.5, 0.8]], dtype=torch.float64)
    torch.testing.assert_close(loss[:, :3], expected)
    assert loss[1, 3].item() == pytest.approx(4.0)
    # d loss / d logp = -A·ρ where unclipped (dρ/dlogp = ρ), 0 where clipped, 0 on the masked token
    aggregate(loss, mask, "token-mean", n_tokens=1).backward()
    torch.testing.assert_close(logp.grad, T([[-1.0, 0, -0.5, 0], [1.0, 1.5, 0, 4.0]], dtype=torch.float64))
    # 7 valid tokens, 2 clipped (1.5 for A>0, 0.5 for A<0); ratio mean (1+1.5+0.5 + 1+1.5+0.5+4)/7 = 10/7
    assert m["clip_frac"] == pytest.approx(2 / 7)
    assert m["ratio_mean"] == pytest.approx(10 / 7)
    assert m["ratio_max"] == pytest.approx(4.0)  # the largest valid token's; the masked one is left out
    assert m["clip_frac_dual"] == 0.0


def test_ppo_clip_ratio_is_against_stored_old_logp():
    # same current log-probs, two different stored behaviour log-probs -> different ratios and losses
    logp = T([[math.log(0.3)]], dtype=torch.float64)
    adv, mask = T([[1.0]], dtype=torch.float64), T([[1]])
    fn = get_policy_loss("ppo_clip")
    loss_a, m_a = fn(logp, T([[math.log(0.3)]], dtype=torch.float64), adv, mask, LossConfig())
    loss_b, m_b = fn(logp, T([[math.log(0.27)]], dtype=torch.float64), adv, mask, LossConfig())
    assert m_a["ratio_mean"] == pytest.approx(1.0) and loss_a.item() == pytest.approx(-1.0)
    # ρ = 0.3 / 0.27 = 1.1111, inside [0.8, 1.2] -> loss -1.1111
    assert m_b["ratio_mean"] == pytest.approx(0.3 / 0.27) and loss_b.item() == pytest.approx(-0.3 / 0.27)


def test_ppo_clip_higher_dapo():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)  # bounds [0.8, 1.28]
    logp, old = logps_from_ratios([[1.25, 1.5, 0.7]])
    adv = T([[1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, m = get_policy_loss("ppo_clip")(logp, old, adv, T([[1, 1, 1]]), cfg)
    # ρ=1.25, A=+1: 1.25 < 1.28 -> unclipped, -1.25 (symmetric 0.2 would have clipped it to -1.2)
    # ρ=1.5,  A=+1: clipped at 1.28 -> -1.28
    # ρ=0.7,  A=-1: lower bound still 0.8 -> max(0.7, 0.8) = 0.8, clipped
    torch.testing.assert_close(loss, T([[-1.25, -1.28, 0.8]], dtype=torch.float64))
    assert m["clip_frac"] == pytest.approx(2 / 3)
    sym, _ = get_policy_loss("ppo_clip")(logp, old, adv, T([[1, 1, 1]]), LossConfig())
    assert sym[0, 0].item() == pytest.approx(-1.2)


def test_ppo_dual_clip():
    cfg = LossConfig(dual_clip=3.0)
    logp, old = logps_from_ratios([[4.0, 2.5, 4.0]], old_prob=0.1)
    adv = T([[-2.0, -2.0, 2.0]], dtype=torch.float64)
    loss, m = get_policy_loss("ppo_clip")(logp, old, adv, T([[1, 1, 1]]), cfg)
    # ρ=4,   A=-2: PPO gives max(2·4, 2·1.2) = 8; dual clip caps at -A·c = 2·3 = 6 -> 6, no gradient
    # ρ=2.5, A=-2: max(5, 2.4) = 5 < 6 -> 5, gradient -A·ρ = 5
    # ρ=4,   A=+2: dual clip is for A<0 only -> -2·min(4, 1.2) = -2.4 (upper clip)
    torch.testing.assert_close(loss, T([[6.0, 5.0, -2.4]], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, T([[0.0, 5.0, 0.0]], dtype=torch.float64))
    assert m["clip_frac"] == pytest.approx(2 / 3) and m["clip_frac_dual"] == pytest.approx(1 / 3)
    # without dual clip the first token keeps its full loss 8
    plain, _ = get_policy_loss("ppo_clip")(logp.detach(), old, adv, T([[1, 1, 1]]), LossConfig())
    assert plain[0, 0].item() == pytest.approx(8.0)


# ---------------------------------------------------------------------------------------------------------------
# gspo
# ---------------------------------------------------------------------------------------------------------------
def test_gspo_sequence_ratio_by_hand_and_gradient():
    old = torch.zeros(2, 3, dtype=torch.float64)
    # seq 0: log-ratios [0.1, 0.3, (masked 5.0)] -> mean over VALID tokens 0.2 -> s = e^0.2 = 1.2214 (over all 3
    #        tokens it would be 1.8); A=+1 -> clipped at 1.2 -> loss -1.2 at each token, no gradient
    # seq 1: log-ratios [-0.1, 0.0, 0.1] -> mean 0 -> s = 1; A=-1 -> loss 1 at each token
    logp = T([[0.1, 0.3, 5.0], [-0.1, 0.0, 0.1]], dtype=torch.float64).requires_grad_()
    adv = T([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    mask = T([[1, 1, 0], [1, 1, 1]])
    loss, m = get_policy_loss("gspo")(logp, old, adv, mask, LossConfig())
    torch.testing.assert_close(loss[0, :2], T([-1.2, -1.2], dtype=torch.float64))
    torch.testing.assert_close(loss[1], T([1.0, 1.0, 1.0], dtype=torch.float64))
    assert m["clip_frac"] == pytest.approx(2 / 5)  # the 2 valid tokens of seq 0 out of 5
    assert m["ratio_mean"] == pytest.approx((2 * math.exp(0.2) + 3 * 1.0) / 5)
    total = aggregate(loss, mask, "seq-mean-token-mean")  # (-1.2 + 1) / 2 = -0.1
    assert total.item() == pytest.approx(-0.1)
    total.backward()

    # the sequence-level GSPO objective written directly: mean_i max(-A_i s_i, -A_i clip(s_i)), full gradient
    logp2 = logp.detach().clone().requires_grad_()
    mf = mask.double()
    s = torch.exp((logp2 * mf).sum(-1) / mf.sum(-1))  # (B,)
    a = adv[:, 0]
    ref = torch.maximum(-a * s, -a * s.clamp(0.8, 1.2)).mean()
    ref.backward()
    # seq 1: d/dlogp_t = (1/2)·(-A)·s·(1/3) = 1/6 per token; seq 0 clipped -> 0
    torch.testing.assert_close(logp.grad, logp2.grad)
    torch.testing.assert_close(logp.grad[1], torch.full((3,), 1 / 6, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------------
# balanced_clip
# ---------------------------------------------------------------------------------------------------------------
def run_balanced(ratios, advs, cfg=None, mask=None):
    logp, old = logps_from_ratios([ratios])
    adv = T([advs], dtype=torch.float64)
    mask = T([[1] * len(ratios)]) if mask is None else mask
    return get_policy_loss("balanced_clip")(logp, old, adv, mask, cfg or LossConfig())


def test_balanced_clip_initial_bounds_suffice():
    # c_low = 0.6, c_high = 1.2: pos = min(1,1.2)·1 + min(1,1.2)·1 = 2, neg = |max(1,0.6)·(-1)| = 1
    # share 2/3 >= 0.5 -> bounds stay at the range minima
    _, m = run_balanced([1.0, 1.0, 1.0], [1.0, 1.0, -1.0])
    assert (m["bac_clip_low"], m["bac_clip_high"]) == (0.6, 1.2)
    assert m["bac_pos_share"] == pytest.approx(2 / 3)


def test_balanced_clip_raises_low_to_max_then_high():
    # tokens: ρ=2.0 A=+1;  ρ=0.5 A=-1;  ρ=0.97 A=-1
    # pos(c_high) = min(2, c_high);  neg(c_low) = max(0.5, c_low) + max(0.97, c_low) = c_low + 0.97 (c_low <= 0.9)
    # c_low phase (c_high = 1.2, pos = 1.2): c_low 0.60 -> share 1.2/(1.2+1.57) = 0.433; raising c_low only adds
    #   to neg: 0.65 -> 1.2/2.82 ... 0.90 -> 1.2/(1.2+1.87) = 0.391 < 0.5 -> c_low ends at its max 0.9 (6 steps)
    # c_high phase (neg = 1.87): need pos >= 1.87: 1.85 -> 1.85/3.72 = 0.4973 < 0.5; 1.90 -> 1.90/3.77 = 0.5040
    #   -> c_high = 1.90 (14 steps of 0.05 from 1.2)
    loss, m = run_balanced([2.0, 0.5, 0.97], [1.0, -1.0, -1.0])
    assert m["bac_clip_low"] == pytest.approx(0.9) and m["bac_clip_high"] == pytest.approx(1.9)
    assert m["bac_pos_share"] == pytest.approx(1.9 / 3.77)
    # PPO with [0.9, 1.9]: ρ=2, A=+1 -> -1.9 (clipped); ρ=0.5, A=-1 -> max(0.5, 0.9) = 0.9 (clipped); ρ=0.97 -> 0.97
    torch.testing.assert_close(loss, T([[-1.9, 0.9, 0.97]], dtype=torch.float64))
    assert m["clip_frac"] == pytest.approx(2 / 3)
    # the same data under plain PPO [0.8, 1.2]: -1.2, 0.8, 0.97
    ppo, _ = get_policy_loss("ppo_clip")(*logps_from_ratios([[2.0, 0.5, 0.97]]), T([[1.0, -1.0, -1.0]]).double(),
                                         T([[1, 1, 1]]), LossConfig())
    torch.testing.assert_close(ppo, T([[-1.2, 0.8, 0.97]], dtype=torch.float64))


def test_balanced_clip_never_exceeds_maxima():
    # only negative advantages: pos = 0, share 0 at every bound -> both bounds end exactly at their maxima
    _, m = run_balanced([1.0, 2.0], [-1.0, -1.0])
    assert (m["bac_clip_low"], m["bac_clip_high"]) == (0.9, 3.0)
    assert m["bac_pos_share"] == 0.0
    # a step that does not divide the range: 0.6, 0.67, 0.74, 0.81, 0.88, then 0.95 is capped to 0.9;
    # 1.2 + 26·0.07 = 3.02 is capped to 3.0
    _, m = run_balanced([1.0, 2.0], [-1.0, -1.0], LossConfig(bac_step=0.07))
    assert (m["bac_clip_low"], m["bac_clip_high"]) == (0.9, 3.0)
    # a positive token with ρ far above every c_high: pos = min(ρ, 3.0) <= 3 < neg = 10·1 -> maxima again
    _, m = run_balanced([50.0, 1.0], [1.0, -10.0])
    assert (m["bac_clip_low"], m["bac_clip_high"]) == (0.9, 3.0)
    assert m["bac_pos_share"] == pytest.approx(3.0 / 13.0)


def test_balanced_clip_endpoints():
    # share exactly ρ0 counts as reached (>=): pos = 1·1 = 1, neg = 1·1 = 1, share 0.5 (exact in float64)
    _, m = run_balanced([1.0, 1.0], [1.0, -1.0])
    assert (m["bac_clip_low"], m["bac_clip_high"]) == (0.6, 1.2) and m["bac_pos_share"] == 0.5
    # nothing to balance (all advantages 0, or no valid token): share taken as 1, bounds at the minima
    _, m = run_balanced([1.0, 3.0], [0.0, 0.0])
    assert (m["bac_clip_low"], m["bac_clip_high"]) == (0.6, 1.2)
    _, m = run_balanced([1.0, 3.0], [1.0, -1.0], mask=T([[0, 0]]))
    assert (m["bac_clip_low"], m["bac_clip_high"]) == (0.6, 1.2)
    # a degenerate range (min == max) is never stepped; c_high goes straight to its own phase
    _, m = run_balanced([1.0, 1.0], [1.0, -3.0], LossConfig(bac_clip_low_range=(0.8, 0.8)))
    # neg = 3·max(1, 0.8) = 3; pos = min(1, c_high) = 1 for every c_high -> never reached -> (0.8, 3.0)
    assert (m["bac_clip_low"], m["bac_clip_high"]) == (0.8, 3.0)
    # c_high stops at the first step reaching the target, reached right at b+ = 3.0:
    # pos = min(3.0, c)·1, neg = max(1, c_low)·3 = 3 -> share(c=2.95) = 2.95/5.95 < 0.5, share(3.0) = 0.5
    _, m = run_balanced([3.0, 1.0], [1.0, -3.0])
    assert (m["bac_clip_low"], m["bac_clip_high"]) == (0.9, 3.0) and m["bac_pos_share"] == pytest.approx(0.5)


def test_balanced_clip_reduce_hook_sums_ranks():
    """Two 'ranks' each adding the other's statistics choose the bounds of the concatenated batch."""
    cfg = LossConfig()
    x = ([2.0], [1.0])  # alone: only a positive token -> share 1 -> bounds at the minima (0.6, 1.2)
    y = ([0.5, 0.97], [-1.0, -1.0])  # alone: pos 0 -> bounds at the maxima (0.9, 3.0)
    # together: the case of test_balanced_clip_raises_low_to_max_then_high -> (0.9, 1.9)

    def stats(r, a):
        ones = torch.ones(1, len(r))
        return balanced_clip_stats(T([r], dtype=torch.float64), T([a], dtype=torch.float64), ones, cfg)

    calls = []

    def adding(other):
        def reduce(t):
            calls.append(t.shape)
            return t + other

        return reduce

    key = ("bac_clip_low", "bac_clip_high")
    bounds = lambda m: tuple(m[k] for k in key)  # noqa: E731
    assert bounds(run_balanced(*x, cfg)[1]) == (0.6, 1.2)
    assert bounds(run_balanced(*y, cfg)[1]) == (0.9, 3.0)
    on_x = run_balanced(*x, LossConfig(bac_reduce=adding(stats(*y))))[1]
    on_y = run_balanced(*y, LossConfig(bac_reduce=adding(stats(*x))))[1]
    both = run_balanced(x[0] + y[0], x[1] + y[1], cfg)[1]
    assert bounds(on_x) == bounds(on_y) == bounds(both) == pytest.approx((0.9, 1.9))
    assert len(calls) == 2  # one hook call per loss call: one collective, whatever the data


def test_all_reduce_sum_hook_with_torch_distributed(tmp_path):
    import torch.distributed as dist

    from bapo_vl.losses import all_reduce_sum

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        loss, m = run_balanced([2.0, 0.5, 0.97], [1.0, -1.0, -1.0], LossConfig(bac_reduce=all_reduce_sum()))
        assert (m["bac_clip_low"], m["bac_clip_high"]) == pytest.approx((0.9, 1.9))  # one rank: sum = itself
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# kl, entropy, IS weights
# ---------------------------------------------------------------------------------------------------------------
def test_kl_k3_by_hand():
    # logp = log 0.5, ref = log 0.25: d = ref - logp = log 0.5 = -0.693147; e^d - d - 1 = 0.5 + 0.693147 - 1
    k = kl_k3(T([math.log(0.5)]), T([math.log(0.25)]))
    assert k.item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)  # 0.193147
    # the other way round: d = log 2: 2 - 0.693147 - 1 = 0.306853
    assert kl_k3(T([math.log(0.25)]), T([math.log(0.5)])).item() == pytest.approx(1 - math.log(2), abs=1e-6)
    x = torch.randn(5, 7)
    assert torch.equal(kl_k3(x, x), torch.zeros(5, 7))
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 33, generator=g) * 5, torch.randn(64, 33, generator=g) * 5
    assert (kl_k3(a, b) >= 0).all()
    # clamped log-ratio: a huge gap stays finite (e^20 - 20 - 1)
    assert kl_k3(T([0.0]), T([1000.0])).item() == pytest.approx(math.exp(20) - 21, rel=1e-5)


def test_entropy_from_logits():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 4
    p = logits.softmax(-1)
    expected = -(p * p.log()).sum(-1)  # (3, 5)
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=4), expected)  # chunks across rows
    # uniform over V=50 -> log 50, whatever the constant; huge logits don't overflow
    assert torch.allclose(entropy_from_logits(torch.full((2, 3, 50), 7.0)), torch.full((2, 3), math.log(50)))
    assert torch.allclose(entropy_from_logits(torch.full((1, 1, 50), 1e4)), torch.full((1, 1), math.log(50)))
    # bf16 input -> float32 output; gradient flows
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32
    z = logits.clone().requires_grad_()
    entropy_from_logits(z, chunk_size=2).sum().backward()
    z2 = logits.clone().requires_grad_()
    q = z2.softmax(-1)
    (-(q * q.log()).sum()).backward()
    torch.testing.assert_close(z.grad, z2.grad)


def test_truncated_is_weights():
    prox = T([math.log(0.5), math.log(0.9), math.log(0.1)]).requires_grad_()
    beh = T([math.log(0.25), math.log(0.1), math.log(0.1)])
    w = truncated_is_weights(prox, beh, threshold=3.0)
    # 0.5/0.25 = 2 (kept); 0.9/0.1 = 9 -> truncated to 3; 0.1/0.1 = 1
    torch.testing.assert_close(w, T([2.0, 3.0, 1.0]))
    assert not w.requires_grad


# ---------------------------------------------------------------------------------------------------------------
# aggregate
# ---------------------------------------------------------------------------------------------------------------
def test_aggregate_modes_by_hand():
    x = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    # token-mean: (1 + 2 + 4) / 3 = 7/3
    assert aggregate(x, mask, "token-mean").item() == pytest.approx(7 / 3)
    # seq-mean-token-mean: ((1+2)/2 + 4/1) / 2 = (1.5 + 4) / 2 = 2.75
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)
    # seq-mean-token-sum: ((1+2) + 4) / 2 = 3.5
    assert aggregate(x, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)
    # explicit denominators
    assert aggregate(x, mask, "token-mean", n_tokens=10).item() == pytest.approx(0.7)
    assert aggregate(x, mask, "seq-mean-token-sum", n_seqs=7).item() == pytest.approx(1.0)
    # a fully masked row counts in the default B: (1.5 + 4 + 0) / 3
    x3, m3 = torch.cat([x, T([[9.0, 9.0, 9.0]])]), torch.cat([mask, T([[0, 0, 0]])])
    assert aggregate(x3, m3, "seq-mean-token-mean").item() == pytest.approx(5.5 / 3)
    # NaN / inf on padding never leaks into the result or the gradient
    bad = T([[1.0, float("nan")], [float("inf"), 2.0]], requires_grad=True)
    out = aggregate(bad, T([[1, 0], [0, 1]]), "token-mean")
    out.backward()
    assert out.item() == pytest.approx(1.5) and torch.isfinite(bad.grad).all()
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(x, mask, "sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregate_gradient_accumulation(mode):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 9, generator=g, dtype=torch.float64)
    lengths = T([9, 1, 4, 7, 2, 5])
    mask = (torch.arange(9)[None] < lengths[:, None]).long()  # ragged: 9+1+4+7+2+5 = 28 tokens, 6 sequences
    whole = aggregate(x, mask, mode)
    n_tok, n_seq = int(mask.sum()), mask.shape[0]
    parts = [aggregate(x[s], mask[s], mode, n_tokens=n_tok, n_seqs=n_seq) for s in (slice(0, 2), slice(2, 6))]
    torch.testing.assert_close(parts[0] + parts[1], whole)
    if mode == "token-mean":  # without the whole count the micro-batch means would NOT add up
        # micro-batch means re-weighted by their token counts 10 and 18 of 28 also give it
        naive = aggregate(x[:2], mask[:2], mode) * 10 / 28 + aggregate(x[2:], mask[2:], mode) * 18 / 28
        torch.testing.assert_close(naive, whole)
        assert not torch.allclose(aggregate(x[:2], mask[:2], mode) + aggregate(x[2:], mask[2:], mode), whole)


# ---------------------------------------------------------------------------------------------------------------
# total_loss and the registry
# ---------------------------------------------------------------------------------------------------------------
def test_total_loss_by_hand():
    logp = torch.full((2, 2), math.log(0.5), dtype=torch.float64, requires_grad=True)
    old = logp.detach().clone()  # ρ = 1 everywhere -> pg per token = -A
    adv = T([[1.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    mask = T([[1, 1], [1, 1]])
    ref = torch.full((2, 2), math.log(0.25), dtype=torch.float64)
    ent = T([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    loss, m = total_loss(logp, old, adv, mask, cfg, ref_logp=ref, entropy=ent)
    # pg = (-1 - 1 + 1 + 0)/4 = -0.25;  kl = 0.5 + ln 2 - 1 = 0.193147 per token;  entropy mean 2.5
    # loss = -0.25 + 0.1·0.193147 - 0.01·2.5 = -0.2556853
    k3 = 0.5 + math.log(2) - 1
    assert m["pg_loss"] == pytest.approx(-0.25)
    assert m["kl"] == pytest.approx(k3)
    assert m["entropy"] == pytest.approx(2.5)
    assert loss.item() == pytest.approx(-0.25 + 0.1 * k3 - 0.025) and m["loss"] == pytest.approx(loss.item())
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0) and m["n_valid_tokens"] == 4

    # truncated-IS weights multiply the policy term only, detached: pg = (-0.5 - 1 + 2 + 0)/4 = 0.125
    w = T([[0.5, 1.0], [2.0, 1.0]], dtype=torch.float64, requires_grad=True)
    loss_w, m_w = total_loss(logp, old, adv, mask, LossConfig(kl_coef=0, entropy_coef=0), is_weights=w)
    assert m_w["pg_loss"] == pytest.approx(0.125) and loss_w.item() == pytest.approx(0.125)
    assert m_w["kl"] == 0.0 and m_w["entropy"] == 0.0  # terms not given
    loss_w.backward()
    assert w.grad is None
    # d/dlogp of (1/4)·Σ -A·w·ρ at ρ = 1 is -A·w/4
    torch.testing.assert_close(logp.grad, T([[-0.125, -0.25], [0.5, 0.0]], dtype=torch.float64))


def test_total_loss_kl_reported_but_not_added_when_coef_zero():
    logp = torch.full((1, 2), math.log(0.5), dtype=torch.float64, requires_grad=True)
    ref = torch.full((1, 2), math.log(0.25), dtype=torch.float64)
    adv, mask = torch.zeros(1, 2, dtype=torch.float64), T([[1, 1]])
    loss, m = total_loss(logp, logp.detach(), adv, mask, LossConfig(kl_coef=0.0), ref_logp=ref)
    assert m["kl"] == pytest.approx(0.5 + math.log(2) - 1) and loss.item() == 0.0


def test_total_loss_seq_mean_agg_and_grad_accumulation():
    g = torch.Generator().manual_seed(4)
    B, Tn = 4, 5
    old = torch.randn(B, Tn, generator=g, dtype=torch.float64) - 2
    logp = (old + 0.3 * torch.randn(B, Tn, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, Tn)
    ref = old + 0.1
    mask = (torch.arange(Tn)[None] < T([5, 2, 3, 1])[:, None]).long()
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        cfg = LossConfig(agg=agg, kl_coef=0.05)
        whole, _ = total_loss(logp, old, adv, mask, cfg, ref_logp=ref)
        n_tok = int(mask.sum())
        parts = [total_loss(logp[s], old[s], adv[s], mask[s], cfg, ref_logp=ref[s], n_tokens=n_tok, n_seqs=B)[0]
                 for s in (slice(0, 1), slice(1, 4))]
        torch.testing.assert_close(parts[0] + parts[1], whole)


def test_registry_and_unknown_name():
    assert {"ppo_clip", "gspo", "balanced_clip"} <= set(policy_loss_names())
    with pytest.raises(ValueError) as e:
        get_policy_loss("grpo_typo")
    for name in ("ppo_clip", "gspo", "balanced_clip"):
        assert name in str(e.value)
    with pytest.raises(ValueError, match="known: .*ppo_clip"):
        total_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), LossConfig(name="nope"))
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo_clip")(lambda *a: None)


def test_custom_policy_loss_plugs_in():
    @register_policy_loss("test_reinforce")
    def reinforce(logp, old_logp, adv, mask, cfg):
        return -adv * logp, {"clip_frac": 0.0, "ratio_mean": 1.0}

    try:
        loss, m = total_loss(T([[-1.0, -2.0]]), T([[0.0, 0.0]]), T([[1.0, 1.0]]), T([[1, 1]]),
                             LossConfig(name="test_reinforce", kl_coef=0, entropy_coef=0))
        assert loss.item() == pytest.approx(1.5)  # -(1·-1 + 1·-2)/2
    finally:
        from bapo_vl import losses

        losses.POLICY_LOSSES.pop("test_reinforce")


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "balanced_clip"])
def test_total_loss_metrics_can_stay_on_the_device_until_one_transfer(name):
    # Could fail if host_metrics=False still moved a metric to the host (each move waits for the device), if the
    # tensors it returns differed from the floats of the default call, or if a custom loss's float metrics were lost.
    g = torch.Generator().manual_seed(5)
    old = torch.randn(3, 4, generator=g) - 2
    logp = (old + 0.3 * torch.randn(3, 4, generator=g)).requires_grad_()
    adv, mask = torch.randn(3, 1, generator=g).expand(3, 4), T([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    cfg = LossConfig(name=name, kl_coef=0.1, entropy_coef=0.01)
    ent = torch.rand(3, 4, generator=g)
    loss, floats = total_loss(logp, old, adv, mask, cfg, ref_logp=old + 0.1, entropy=ent, n_tokens=9, n_seqs=3)
    kept_loss, kept = total_loss(logp, old, adv, mask, cfg, ref_logp=old + 0.1, entropy=ent, n_tokens=9, n_seqs=3,
                                 host_metrics=False)
    assert all(type(v) is float for v in floats.values())
    on_device = {k for k, v in kept.items() if isinstance(v, torch.Tensor)}
    assert {"loss", "pg_loss", "kl", "entropy", "n_valid_tokens"} <= on_device
    # balanced_clip picks its bounds on the host (one transfer of its candidate sums) and reports floats, which
    # verl's metrics take as they are; the other losses leave theirs on the device too
    assert ({"clip_frac", "ratio_mean"} <= on_device) == (name != "balanced_clip")
    assert all(kept[k].dim() == 0 and not kept[k].requires_grad for k in on_device)
    assert to_host(kept) == floats and torch.equal(kept_loss, loss)
    assert floats["n_valid_tokens"] == 7 and floats["loss"] == pytest.approx(loss.item())


def test_config_checks():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        LossConfig(agg="seq-mean")
    with pytest.raises(ValueError, match="low end"):
        LossConfig(bac_clip_low_range=(0.9, 0.6))
    with pytest.raises(ValueError, match="> 1"):
        LossConfig(dual_clip=0.5)
    assert LossConfig(bac_clip_high_range=[1.2, 2.0]).bac_clip_high_range == (1.2, 2.0)  # from YAML lists


def test_config_carries_every_loss_setting():
    """One config object: the config's loss group is a LossConfig, each of its fields but the DP hook a config key,
    and bad loss settings fail when the config is loaded, naming the setting."""
    import dataclasses

    from bapo_vl.config import FIELDS, GROUP_OF, Config, load_config

    cfg = load_config(overrides=["loss=balanced_clip", "bac_target=0.7", "bac_clip_low_range=[0.5, 0.9]",
                                 "clip_high=0.28", "loss_agg=seq-mean-token-sum"])
    lc = cfg.loss
    assert (lc.name, lc.bac_target, lc.bac_clip_low_range, lc.clip_high, lc.agg) == \
        ("balanced_clip", 0.7, (0.5, 0.9), 0.28, "seq-mean-token-sum")
    assert Config().loss == LossConfig()
    settings = [f for f in dataclasses.fields(LossConfig) if f.name != "bac_reduce"]
    assert all(FIELDS[key] is f and GROUP_OF[key] == "loss" for key, f in FIELDS.items() if f in settings)
    assert len([key for key in FIELDS if GROUP_OF[key] == "loss"]) == len(settings)
    with pytest.raises(ValueError, match="loss='ppo': choose one of ppo_clip"):
        load_config(overrides=["loss=ppo"])
    with pytest.raises(ValueError, match="bac_clip_low_range"):
        load_config(overrides=["loss=balanced_clip", "bac_clip_low_range=[0.9, 0.5]"])


# --- BA-PPO: GAE and the value loss, against verl's own functions ---------------------------------------------------

def test_gae_with_gamma_lambda_one_is_reward_minus_value_and_matches_verl():
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    from bapo_vl.losses import gae_advantages

    gen = torch.Generator().manual_seed(0)
    values = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = (torch.arange(7)[None] < torch.tensor([[7], [4], [1], [6], [3]])).double()
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, mask)
    token_rewards = torch.zeros_like(values)
    token_rewards[torch.arange(5), mask.sum(-1).long() - 1] = rewards
    want_adv, want_ret = compute_gae_advantage_return(token_rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv * mask, want_adv * mask)
    torch.testing.assert_close(ret * mask, want_ret * mask)
    # γ = λ = 1: before whitening A_t = r − V(s_t), so returns are the outcome reward on every valid token
    torch.testing.assert_close(ret * mask, rewards[:, None].expand(5, 7) * mask)
    adv2, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    want2, _ = compute_gae_advantage_return(token_rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv2 * mask, want2 * mask)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_verl(agg):
    from verl.trainer.ppo.core_algos import compute_value_loss

    from bapo_vl.losses import value_loss

    gen = torch.Generator().manual_seed(1)
    old = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    new = old + torch.randn(4, 6, generator=gen, dtype=torch.float64)
    ret = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = (torch.arange(6)[None] < torch.tensor([[6], [2], [5], [1]])).double()
    loss, m = value_loss(new, old, ret, mask, clip=0.5, agg=agg)
    want, frac = compute_value_loss(new, ret, old, mask, cliprange_value=0.5, loss_agg_mode=agg)
    torch.testing.assert_close(loss, want)
    assert m["vf_clipfrac"] == pytest.approx(float(frac)) and 0 < m["vf_clipfrac"] < 1


def test_an_updates_largest_ratio_is_the_largest_of_its_micro_batches():
    # Could fail if the embedded update averaged the largest ratio like the per-token means (a token 800x off the
    # behaviour policy in one micro-batch of four would show as ~200), or mixed it into the token-weighted means.
    from bapo_vl.backends.embedded import _combine

    micro = [dict(loss=T(0.5), pg_loss=T(0.5), kl=T(0.0), entropy=T(0.1), ratio_mean=T(r), ratio_max=T(top),
                  clip_frac=T(0.0), n_valid_tokens=T(n)) for r, top, n in ((1.0, 1.2, 30.0), (2.0, 800.0, 10.0))]
    out = _combine(micro)
    assert out["ratio_max"].item() == 800.0 and out["loss"].item() == 1.0
    assert out["ratio_mean"].item() == pytest.approx((1.0 * 30 + 2.0 * 10) / 40)
