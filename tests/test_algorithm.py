"""The batch-adaptation rules of SPEC sections 1-2, with hand-computed expectations."""
import random

import pytest

from bapo_vl.algorithm import (PROMOTE_RULES, BadBuffer, Group, HighBuffer, Sample, Thresholds, get_filter, get_promote,
                               is_promoted, register_promote, sample_replay)
from bapo_vl.config import ALGOS, BapoSettings, Config, load_config
from bapo_vl.problem import Problem


def group(uid: str, correct: int, G: int = 8, step: int = 1) -> Group:
    samples = [Sample([1], [-0.1], "", 1.0 if j < correct else 0.0) for j in range(G)]
    return Group(Problem(uid, [{"role": "user", "content": uid}], None), samples, step=step, version=0)


def test_group_mean_accuracy():
    assert group("a", 3).mu == 3 / 8
    assert group("a", 0).mu == 0 and group("a", 8).mu == 1


# --- X1 filters ---------------------------------------------------------------------------------------------


def test_range_filter_keeps_one_to_g_minus_one():
    groups = [group(str(k), k) for k in range(9)]  # 0/8 .. 8/8
    kept = get_filter("range")(groups, BapoSettings(), random.Random(0))
    assert [g.correct for g in kept] == [1, 2, 3, 4, 5, 6, 7]  # 0/8 and 8/8 have zero advantage


def test_gaussian_filter_keeps_with_normal_probability():
    cfg = BapoSettings(gaussian_mean=0.5, gaussian_std=0.2)
    rng = random.Random(0)
    n = 4000
    # mu = 0.5 -> probability 1; mu = 0.25 -> exp(-0.5 * (0.25/0.2)^2) = exp(-0.78125) = 0.4578
    assert len(get_filter("gaussian")([group(str(i), 4) for i in range(n)], cfg, rng)) == n
    kept = len(get_filter("gaussian")([group(str(i), 2) for i in range(n)], cfg, rng))
    assert abs(kept / n - 0.4578) < 0.03
    # mu = 0 -> exp(-0.5 * 2.5^2) = 0.0439: almost all dropped
    assert len(get_filter("gaussian")([group(str(i), 0) for i in range(n)], cfg, rng)) / n < 0.07


def test_uniform_filter_keeps_sixty_percent_regardless_of_mu():
    cfg, rng, n = BapoSettings(), random.Random(1), 4000
    for k in (0, 4, 8):
        kept = len(get_filter("uniform")([group(str(i), k) for i in range(n)], cfg, rng))
        assert abs(kept / n - 0.6) < 0.03


def test_unknown_filter_lists_known():
    with pytest.raises(KeyError, match="range"):
        get_filter("nope")


# --- B_bad -------------------------------------------------------------------------------------------------


def test_bad_buffer_is_fifo_with_capacity():
    bad = BadBuffer(capacity=3)
    for uid in "abcd":
        bad.add(group(uid, 0))
    assert list(bad.groups) == ["b", "c", "d"]  # a, the oldest, evicted
    bad.add(group("b", 1))  # seen again: replaces its entry and becomes the newest
    assert list(bad.groups) == ["c", "d", "b"] and bad.groups["b"].correct == 1
    bad.add(group("e", 0))
    assert list(bad.groups) == ["d", "b", "e"] and len(bad) == 3


def test_bad_buffer_oldest_and_remove():
    bad = BadBuffer(capacity=10)
    for uid in "abcde":
        bad.add(group(uid, 0))
    assert [g.uid for g in bad.oldest(2)] == ["a", "b"]
    assert [g.uid for g in bad.oldest(2, exclude={"a"})] == ["b", "c"]
    bad.remove(["b", "zz"])
    assert list(bad.groups) == ["a", "c", "d", "e"]


# --- B_high ------------------------------------------------------------------------------------------------


def test_high_buffer_keeps_three_most_recent_steps():
    high = HighBuffer(max_age=3)
    for step in range(1, 6):
        high.add(group(f"s{step}", 3, step=step))
    high.evict_older_than(5)  # keeps steps 3, 4, 5
    assert sorted(high.groups) == ["s3", "s4", "s5"]


def test_high_buffer_uid_cap_keeps_newest():
    high = HighBuffer(max_age=3, max_uids=2)
    for uid in "abc":
        high.add(group(uid, 3))
    assert list(high.groups) == ["b", "c"]


# --- X2 promotion ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("correct_new, expected", [
    (0, False),  # still unsolved
    (1, False),  # 1/8 is not > c1 = 1/8
    (2, True),  # 2/8 > 1/8 and < 1
    (7, True),
    (8, False),  # mu_new = 1: all correct, no gradient signal
])
def test_promotion_threshold_rule(correct_new, expected):
    assert is_promoted(group("a", correct_new), group("a", 0), c1=1 / 8, rule="threshold") is expected


@pytest.mark.parametrize("old, new, expected", [(0, 1, True), (1, 1, False), (1, 8, True), (0, 0, False)])
def test_promotion_improved_rule(old, new, expected):
    assert is_promoted(group("a", new), group("a", old), c1=1 / 8, rule="improved") is expected


def test_is_promoted_dispatches_through_the_registry(monkeypatch):
    monkeypatch.setitem(PROMOTE_RULES, "never", None)  # teardown removes the rule registered below
    register_promote("never")(lambda new, old, c1: False)
    assert is_promoted(group("a", 4), group("a", 0), c1=1 / 8, rule="threshold") is True
    assert is_promoted(group("a", 4), group("a", 0), c1=1 / 8, rule="never") is False
    with pytest.raises(KeyError, match="threshold, improved"):
        get_promote("nope")


# --- X3 replay ---------------------------------------------------------------------------------------------


def test_replay_fills_at_most_room_from_threshold_window_without_repeating_uids():
    high = HighBuffer(max_age=3)
    for uid, correct in [("a", 2), ("b", 3), ("c", 4), ("d", 6), ("e", 3)]:
        high.add(group(uid, correct, step=1))
    # window c2 = 2/8, c3 = 4/8: a, b, c, e qualify; d (6/8) does not; e is already in the batch
    picked = sample_replay(high, room=10, c2=2 / 8, c3=4 / 8, exclude={"e"}, rng=random.Random(0))
    assert sorted(g.uid for g in picked) == ["a", "b", "c"]
    picked = sample_replay(high, room=2, c2=2 / 8, c3=4 / 8, exclude={"e"}, rng=random.Random(0))
    assert len(picked) == 2 and len({g.uid for g in picked}) == 2 and "d" not in {g.uid for g in picked}
    assert sample_replay(high, room=0, c2=0, c3=1, exclude=set(), rng=random.Random(0)) == []
    assert sample_replay(high, room=-3, c2=0, c3=1, exclude=set(), rng=random.Random(0)) == []


# --- thresholds (eq. 8) ------------------------------------------------------------------------------------


PAPER = dict(c1=1 / 8, c2_range=(1 / 8, 4 / 8), c3_range=(2 / 8, 5 / 8))  # SPEC section 4


def test_thresholds_take_their_settings_from_config():
    with pytest.raises(TypeError):  # no defaults of their own: Config declares c1, c2_range, c3_range
        Thresholds()


def test_threshold_endpoints():
    th = Thresholds(**PAPER)
    assert th.r_tot == 0 and th.c2 == 1 / 8 and th.c3 == 2 / 8  # r_tot = 0: the low ends
    th.observe([1.0] * 16)
    assert th.r_tot == 1 and th.c2 == 4 / 8 and th.c3 == 5 / 8  # r_tot = 1: the high ends


def test_threshold_running_average():
    th = Thresholds(**PAPER)
    th.observe([1, 0, 0, 0])  # 1/4
    th.observe([1, 1, 0, 0, 0, 0, 0, 0])  # running: 3/12 = 0.25
    assert th.r_tot == pytest.approx(0.25)
    assert th.c2 == pytest.approx(0.25 * (4 / 8 - 1 / 8) + 1 / 8)  # 0.21875
    assert th.c3 == pytest.approx(0.25 * (5 / 8 - 2 / 8) + 2 / 8)  # 0.34375


# --- presets -----------------------------------------------------------------------------------------------


def test_algo_presets_are_field_overrides_of_one_config():
    grpo = load_config(overrides=["algo=grpo"]).bapo
    assert (grpo.delay, grpo.online_filter, grpo.use_x2, grpo.use_x3) == (1, "none", False, False)
    dapo = load_config(overrides=["algo=dapo"])
    assert (dapo.loss.clip_low, dapo.loss.clip_high, dapo.loss.agg, dapo.bapo.dynamic_sampling_rounds) == \
        (0.2, 0.28, "token-mean", 4)
    mini = load_config(overrides=["algo=mini_test"]).bapo
    assert (mini.c1, mini.c2_range, mini.c3_range, mini.reeval_every) == (0.0, (0.5, 0.5), (0.5, 0.5), 1)
    assert load_config(overrides=["algo=grpo_v5"]).bapo.delay == 5
    assert load_config(overrides=["algo=bapo_no_x2"]).bapo.use_x2 is False
    assert load_config(overrides=["algo=bapo_no_x3"]).bapo.use_x3 is False
    assert load_config(overrides=["algo=dapo", "clip_high=0.3"]).loss.clip_high == 0.3  # later overrides win
    assert set(ALGOS) >= {"bapo", "grpo", "grpo_v5", "dapo", "bapo_no_x2", "bapo_no_x3", "mini_test"}


def test_paper_defaults():
    cfg = Config()
    sampling, bapo, optim, loss = cfg.sampling, cfg.bapo, cfg.optim, cfg.loss
    assert (sampling.group_size, sampling.batch_size) == (8, 256)
    assert (bapo.delay, bapo.reeval_every, bapo.reeval_max) == (5, 5, 128)
    assert (bapo.c1, bapo.c2_range, bapo.c3_range) == (1 / 8, (1 / 8, 4 / 8), (2 / 8, 5 / 8))
    assert (optim.lr, optim.mini_batch_size) == (1e-6, 64)
    assert (loss.kl_coef, loss.entropy_coef, loss.clip_low) == (1e-3, 1e-3, 0.2)


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="group_size=8"):
        Config.from_dict(dict(group_size=1))
    with pytest.raises(KeyError, match="unknown config key 'lr_rate'"):
        load_config(overrides=["lr_rate=1"])
    with pytest.raises(ValueError, match="choose one of"):
        load_config(overrides=["algo=ppo2"])
