"""The trainer end to end: the real embedded backend, a real (tiny, random) saved Qwen2 and a task plugin loaded
from an extra folder. Nothing is mocked: what is checked is what `bapo train` does (SPEC sections 1-2 and 5).

The `parity` task makes a random model useful: a response is correct when its first character has an even code
point. A random tiny model puts roughly a quarter of its mass there, so groups of 8 land in every accuracy bin
from 0/8 to about 5/8 - enough for the online filter, B_bad, B_high, re-evaluation and replay to all have work.
"""
import copy
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import bapo_vl.train
from bapo_vl.config import load_config
from bapo_vl.plugins import get_task
from bapo_vl.problem import Problem, Verdict
from bapo_vl.reader import read_run
from bapo_vl.record import query_ro
from bapo_vl.tiny import build_qwen2
from bapo_vl.train import load_problems, make_backend, train
from bapo_vl.trainer import Trainer

B, G = 8, 8

PARITY = '''
from bapo_vl.problem import Problem, Verdict

NAME = "parity"


def load(split="train", n=64, **_):
    return [Problem(f"parity-{i}", [{"role": "user", "content": f"q{i}"}], None) for i in range(int(n))]


def verify(response, answer):
    if not response:
        return Verdict.UNPARSABLE
    return Verdict.CORRECT if ord(response[0]) % 2 == 0 else Verdict.WRONG
'''

# Same problems; the verifier raises on every response whose first code point is a multiple of 3.
PARITY_RAISES = PARITY.replace('NAME = "parity"', 'NAME = "parity_raises"').replace(
    "    return Verdict.CORRECT if",
    "    if ord(response[0]) % 3 == 0:\n"
    "        raise ValueError(f'cannot read {response!r}')\n"
    "    return Verdict.CORRECT if")


def parity_verdict(text: str, raises: bool = False) -> Verdict:
    """What the trainer must record for `text` (a raising verifier counts as unparsable)."""
    if not text or (raises and ord(text[0]) % 3 == 0):
        return Verdict.UNPARSABLE
    return Verdict.CORRECT if ord(text[0]) % 2 == 0 else Verdict.WRONG


@dataclass
class Env:
    model: Path  # the saved tiny model + tokenizer
    tasks: Path  # extra plugin folder holding parity/ and parity_raises/
    runs: Path


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    root = tmp_path_factory.mktemp("trainer")
    model, tok = build_qwen2()
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    for name, source in (("parity", PARITY), ("parity_raises", PARITY_RAISES)):
        (root / "tasks" / name).mkdir(parents=True)
        (root / "tasks" / name / "task.py").write_text(source)
    return Env(root / "model", root / "tasks", root / "runs")


def config(env: Env, **overrides):
    """The tiny preset pointed at the saved model and the parity plugin, with sizes that run in seconds."""
    values = dict(task="parity", model=env.model, tasks_dirs=f"['{env.tasks}']", run_dir=env.runs, device="cpu",
                  dtype="float32", batch_size=B, group_size=G, max_prompt_length=64, max_response_length=6,
                  steps=6, mini_batch_size=64, micro_batch_size=64, lr=1e-3, log_samples=2)
    values.update(overrides)
    return load_config(overrides=[f"{k}={v}" for k, v in values.items()])


def make_trainer(cfg) -> Trainer:
    task, problems = load_problems(cfg.run)
    return bapo_vl.train.make_trainer(cfg, make_backend(cfg), task, problems)


def test_the_trainer_is_given_the_bapo_settings_and_what_else_it_reads(env):
    # Could fail if the Trainer took the whole Config again, or a setting it reads came from elsewhere.
    cfg = config(env, c1=0.25, high_max_age=2, delay=3, adv_eps=1e-4)
    trainer = make_trainer(cfg)
    assert trainer.bapo is cfg.bapo and not hasattr(trainer, "cfg")
    assert (trainer.batch_size, trainer.group_size, trainer.critic, trainer.adv_eps) == (B, G, False, 1e-4)
    assert (trainer.state.bad.capacity, trainer.state.high.max_age, trainer.state.thresholds.c1) == (B, 2, 0.25)
    same = Trainer(cfg.bapo, trainer.backend, trainer.task, trainer.sampler.problems, batch_size=B, group_size=G,
                   seed=cfg.run.seed, critic=False, adv_eps=1e-4)
    assert [p.uid for p in same.sampler.next(B)] == [p.uid for p in trainer.sampler.next(B)]  # the same seed
    with pytest.raises(TypeError):  # the whole Config is not what it takes
        Trainer(cfg, trainer.backend, trainer.task, trainer.sampler.problems)


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(model, snapshot: dict) -> bool:
    return all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())


# Settings under which X2 and X3 both have work: c1 = 1/8 puts the 0/8 groups (outside X1) in B_bad, and
# re-evaluated they mostly reach 2/8 or more; c2 = 0, c3 = 1 put every fresh group in B_high; re-evaluation every
# 2 steps; the rollout policy is synchronised every 3 steps. (With c1 = 3/8, B_bad fills with groups of the
# current step that are in X1 anyway, so X2 almost never gets a candidate.)
BAPO = dict(c1=0.125, reeval_every=2, c2_range="[0.0, 0.0]", c3_range="[1.0, 1.0]", delay=3)


# --- plugin discovery -------------------------------------------------------------------------------------------


def test_task_plugin_is_found_in_an_extra_folder(env):
    # Could fail if tasks_dirs were not searched, or a second plugin in the folder hid the first.
    task = get_task("parity", [str(env.tasks)])
    assert Path(task.origin) == env.tasks / "parity"
    problems = task.load(split="train", n=5)
    assert [p.uid for p in problems] == [f"parity-{i}" for i in range(5)]
    assert task.verify("b", None) is Verdict.CORRECT and task.verify("a", None) is Verdict.WRONG
    with pytest.raises(KeyError, match="parity"):  # the error lists what was found
        get_task("nope", [str(env.tasks)])


# --- 1. synchronisation schedule of the rollout policy ------------------------------------------------------------


def test_rollout_policy_syncs_every_v_steps(env):
    # Could fail if the sync ran at the wrong steps (t % v != 0, or off by one), if rollout_version counted
    # steps instead of applied updates, or if sync() did not copy the trainer weights into alpha.
    v, T = 3, 7
    trainer = make_trainer(config(env, delay=v, steps=T, use_x2="false", use_x3="false"))
    backend = trainer.backend
    assert backend.rollout is not backend.policy
    versions, alpha = [], weights(backend.rollout)
    for t in range(1, T + 1):
        updates_before, policy_before = trainer.updates, weights(backend.policy)
        result = trainer.step(t)
        m = result.metrics
        assert m["rollout_version"] == trainer.rollout_version
        if t % v == 0:
            assert trainer.rollout_version == updates_before  # alpha = pi_theta as it was before this step's update
            assert same_weights(backend.rollout, policy_before)
        else:
            assert trainer.rollout_version == (versions[-1] if versions else 0)
            assert same_weights(backend.rollout, alpha)  # alpha untouched between syncs
        assert {g.version for g in result.fresh} == {trainer.rollout_version}
        assert m["policy_version"] == updates_before + (1 if result.x1 + result.x2 + result.x3 else 0)
        versions.append(trainer.rollout_version)
        alpha = weights(backend.rollout)
    changes = [t for t in range(2, T + 1) if versions[t - 1] != versions[t - 2]]
    assert changes and all(t % v == 0 for t in changes), versions
    assert versions[-1] > 0, "no update was ever applied: the test would prove nothing"


def test_delay_one_is_on_policy(env):
    # Could fail if delay=1 kept a stale copy (then alpha would lag one update behind pi_theta).
    trainer = make_trainer(config(env, delay=1, steps=3))
    assert trainer.backend.rollout is trainer.backend.policy
    for t in range(1, 4):
        updates_before = trainer.updates
        result = trainer.step(t)
        assert result.metrics["rollout_version"] == updates_before
        assert {g.version for g in result.fresh} == {updates_before}
    assert trainer.updates > 0


# --- a recorded run through train() (used by several tests below) --------------------------------------------------


@pytest.fixture(scope="module")
def recorded_run(env) -> Path:
    cfg = config(env, name="recorded", steps=8, save_every=3, **BAPO)
    return train(cfg, quiet=True)


def test_recorded_rollout_version_follows_the_sync_schedule(recorded_run):
    # Could fail if train() logged a different version than the one the fresh groups came from, or the
    # schedule drifted when driven through train() instead of Trainer.step.
    steps = read_run(recorded_run)["steps"]
    v = 3
    policy_before = 0
    for s in steps:
        if s["step"] % v == 0:
            assert s["rollout_version"] == policy_before
        else:
            assert s["rollout_version"] == (steps[s["step"] - 2]["rollout_version"] if s["step"] > 1 else 0)
        policy_before = s["policy_version"]
    assert steps[-1]["rollout_version"] > 0


def test_each_step_records_where_the_generate_time_went(recorded_run):
    # Could fail if the backend's split of generate (engine sampling, behaviour log-prob scoring) were not recorded,
    # leaked from one step into the next (the trainer clears it each step), or measured something outside generate.
    steps = read_run(recorded_run)["steps"]
    for s in steps:
        sample, logprobs = s["t_generate_sample"], s["t_generate_logprobs"]
        assert sample > 0 and logprobs > 0
        assert sample + logprobs <= s["t_generate"] + 1e-6
        assert s["t_verify"] > 0 and "t_score" not in s  # the verifier's seconds, under the name that says so
    # the split has its own columns, as the other phases do
    columns = query_ro(recorded_run, "SELECT t_generate_sample, t_generate_logprobs, t_verify FROM steps ORDER BY step")
    assert [tuple(r) for r in columns] == [(s["t_generate_sample"], s["t_generate_logprobs"], s["t_verify"])
                                           for s in steps]


# --- 2. re-evaluation schedule ---------------------------------------------------------------------------------


def test_reevaluation_only_every_m_steps_and_at_most_reeval_max(env):
    # Could fail if re-evaluation ran on other steps, ignored reeval_max, re-evaluated prompts already in X1,
    # or re-generated with alpha instead of the current policy pi_theta.
    m_every, k = 2, 2
    trainer = make_trainer(config(env, steps=7, reeval_max=k, reeval_every=m_every, c1=0.375, delay=3))
    reevaluated_at = []
    for t in range(1, 8):
        bad_before = list(trainer.state.bad.groups)  # oldest first
        updates_before = trainer.updates
        result = trainer.step(t)
        m = result.metrics
        assert m["rollouts_reevaluated"] == G * len(result.reevaluated)
        assert m["rollouts"] == m["rollouts_fresh"] + m["rollouts_reevaluated"]
        if t % m_every:
            assert m["rollouts_reevaluated"] == 0 and not result.reevaluated and not result.x2
            continue
        assert len(result.reevaluated) <= k and m["rollouts_reevaluated"] <= k * G
        # B_bad as the re-evaluation saw it: this step's groups with mu <= c1 appended (a seen uid moves to the
        # end), the oldest evicted beyond capacity B; the k oldest outside X1 are re-evaluated.
        stored_now = [g.uid for g in result.fresh if g.mu <= trainer.bapo.c1]
        bad_seen = ([u for u in bad_before if u not in stored_now] + stored_now)[-trainer.batch_size:]
        in_x1 = {g.uid for g in result.x1}
        assert [g.uid for g in result.reevaluated] == [u for u in bad_seen if u not in in_x1][:k]
        assert all(g.step == t and g.version == updates_before and g.source == "reevaluated"
                   for g in result.reevaluated)
        if result.reevaluated:
            reevaluated_at.append(t)
    assert reevaluated_at, "nothing was ever re-evaluated: the test would prove nothing"


# --- 3. batch composition ----------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    t: int
    result: object
    bad: list  # groups in B_bad after the step
    high: list  # groups in B_high after the step


@pytest.fixture(scope="module")
def bapo_steps(env):
    """Eight BAPO steps driven through Trainer.step, with every fresh group's responses copied when first made."""
    trainer = make_trainer(config(env, steps=8, **BAPO))
    born = {}  # id(group) -> (group, tokens, logprobs) at generation time
    snaps = []
    for t in range(1, 9):
        result = trainer.step(t)
        for g in result.fresh + result.reevaluated:
            born[id(g)] = (g, copy.deepcopy([s.tokens for s in g.samples]),
                           copy.deepcopy([s.logprobs for s in g.samples]))
        state = trainer.state
        snaps.append(Snapshot(t, result, list(state.bad.groups.values()), list(state.high.groups.values())))
    return trainer, snaps, born


def test_batch_has_no_uid_twice_and_respects_buffers(bapo_steps):
    # Could fail if X2 or X3 re-used a uid already in the batch, if B_bad held easy groups or grew past B, if B_high
    # kept groups older than high_max_age steps, or if promotion ignored the threshold rule c1 < mu < 1.
    trainer, snaps, born = bapo_steps
    bapo, B = trainer.bapo, trainer.batch_size
    for s in snaps:
        r, t, m = s.result, s.t, s.result.metrics
        batch = r.x1 + r.x2 + r.x3
        assert (m["x1"], m["x2"], m["x3"]) == (len(r.x1), len(r.x2), len(r.x3))
        uids = [g.uid for g in batch]
        assert len(uids) == len(set(uids)), f"step {t}: a uid twice in the batch"
        assert all(g in r.fresh for g in r.x1) and all(0 < g.correct < G for g in r.x1)  # range filter
        # X2: promoted by c1 < mu_new < 1, new responses from this step, and out of B_bad.
        assert all(g in r.reevaluated and bapo.c1 < g.mu < 1 and g.step == t for g in r.x2)
        bad_uids = {g.uid for g in s.bad}
        assert not bad_uids & {g.uid for g in r.x2}
        not_promoted = [g for g in r.reevaluated if g not in r.x2]
        full = len(r.x1) + len(r.x2) == B  # promotion stops when the batch is full
        assert full or all(not (bapo.c1 < g.mu < 1) for g in not_promoted)
        # B_bad: capacity B, only mu <= c1.
        assert len(s.bad) <= B and m["bad_size"] == len(s.bad)
        assert all(g.mu <= bapo.c1 for g in s.bad)
        # B_high: only the last high_max_age steps.
        assert all(g.step >= t - bapo.high_max_age + 1 for g in s.high) and m["high_size"] == len(s.high)
        # X3: from B_high, recent, inside [c2, c3], and the very stored groups (no regeneration).
        for g in r.x3:
            assert g.step >= t - bapo.high_max_age + 1 and g.step <= t
            assert m["c2"] <= g.mu <= m["c3"]
            assert id(g) in born and born[id(g)][0] is g
            assert [smp.tokens for smp in g.samples] == born[id(g)][1]
            assert [smp.logprobs for smp in g.samples] == born[id(g)][2]
            assert g.source == "fresh" and g.version <= trainer.rollout_version


def test_batch_never_exceeds_configured_size(bapo_steps):
    # Could fail if X2 were added on top of a full X1 (X3 is capped by the room left, X2 is not).
    trainer, snaps, _ = bapo_steps
    sizes = [(s.t, len(s.result.x1), len(s.result.x2), len(s.result.x3)) for s in snaps]
    assert all(x1 + x2 + x3 <= trainer.batch_size for _, x1, x2, x3 in sizes), sizes


def test_x2_and_x3_both_used(bapo_steps):
    # Could fail if B_bad never filled (c1 ignored), re-evaluation never promoted, or replay never ran.
    _, snaps, _ = bapo_steps
    assert any(s.result.x2 for s in snaps), [len(s.result.reevaluated) for s in snaps]
    assert any(s.result.x3 for s in snaps), [len(s.result.x3) for s in snaps]


# --- 4. stored behaviour log-probs ----------------------------------------------------------------------------


def test_stored_logprobs_are_the_rollout_policys_right_after_a_sync(env):
    # Could fail if generation scored with the wrong model, at a different temperature or with shifted positions
    # (left padding), or if the delayed copy tracked the trainer weights between syncs.
    trainer = make_trainer(config(env, delay=3, steps=3, use_x2="false", use_x3="false"))
    backend = trainer.backend
    for t in (1, 2):
        trainer.step(t)
    policy_at_sync = weights(backend.policy)
    result = trainer.step(3)  # sync, then generate, then update
    assert trainer.updates > 0
    groups = result.fresh
    prompts = [backend.encode(g.problem) for g in groups for _ in g.samples]  # groups keep no encoding
    tokens = [s.tokens for g in groups for s in g.samples]
    stored = [s.logprobs for g in groups for s in g.samples]
    assert not same_weights(backend.policy, policy_at_sync)  # the update moved pi_theta ...
    assert same_weights(backend.rollout, policy_at_sync)  # ... but not alpha (delay > 1)
    backend.policy.load_state_dict(policy_at_sync)  # pi_theta as it was when the group was generated
    rescored = backend.score(backend.policy, prompts, tokens)
    for a, b in zip(stored, rescored):
        assert torch.allclose(torch.tensor(a), b[:len(a)], atol=1e-5)


def test_sampling_distribution_is_the_scored_one(env, tmp_path):
    # Could fail if generate() inherited a sampling setting (repetition_penalty, top_k, ...) from the saved model's
    # generation_config: the importance ratio would then compare against log-probs of a different distribution.
    model, tok = build_qwen2()
    model.generation_config.repetition_penalty = 1e9  # drives prompt tokens with negative logits to -inf
    model.generation_config.do_sample, model.generation_config.top_k = True, 5  # as Qwen checkpoints ship them
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    backend = make_backend(config(env, model=tmp_path / "m", max_response_length=1, max_prompt_length=128))
    text = "".join(chr(c) for c in range(33, 127))  # 94 distinct byte tokens in the prompt
    prompt = backend.encode(Problem("p", [{"role": "user", "content": text}], None))
    n = 512
    firsts = [r.tokens[0] for r in backend.generate([prompt], n)[0]]
    with torch.no_grad():
        logits = backend.policy(input_ids=prompt["input_ids"][None]).logits[0, -1].float()
    p = torch.softmax(logits / backend.sampling.temperature, -1)
    penalised = {i for i in prompt["input_ids"].tolist() if logits[i] < 0}
    expected = n * float(sum(p[i] for i in penalised))
    observed = sum(1 for f in firsts if f in penalised)
    assert len(set(firsts)) > 5, "top_k of the model's generation_config was applied"
    assert observed > 0.5 * expected, f"{observed} sampled among tokens with probability mass {expected / n:.3f}"


# --- 5. the baselines run on the same trainer ------------------------------------------------------------------


def test_grpo_trains_on_every_fresh_group(env):
    # Could fail if the grpo preset left X2/X3 on, filtered groups, or kept a delayed rollout policy.
    trainer = make_trainer(config(env, algo="grpo", steps=3))
    assert trainer.backend.rollout is trainer.backend.policy
    for t in range(1, 4):
        m = trainer.step(t).metrics
        assert m["x2"] == m["x3"] == 0 and m["rollouts_reevaluated"] == 0
        assert m["x1"] == m["rollouts_fresh"] // G == B
        assert m["bad_size"] == m["high_size"] == 0


def test_dapo_dynamic_sampling_stops_after_four_rounds(env):
    # Could fail if dynamic sampling looped without bound, returned more than B groups, or stopped early.
    trainer = make_trainer(config(env, algo="dapo", steps=3, task_options="{n: 256}"))
    for t in range(1, 4):
        r = trainer.step(t)
        m = r.metrics
        rounds = m["rollouts_fresh"] // (B * G)
        assert m["rollouts_fresh"] == rounds * B * G and 1 <= rounds <= 4
        assert m["x1"] <= B and m["x2"] == m["x3"] == 0
        assert all(0 < g.correct < G for g in r.x1)
        if m["x1"] < B:
            assert rounds == 4  # it only gives up after the last round
        kept_before_last = sum(1 for g in r.fresh[:-B] if 0 < g.correct < G)
        assert kept_before_last < B  # it stops as soon as B groups passed the filter
        uids = [g.uid for g in r.fresh]
        assert len(uids) == len(set(uids))


def test_dapo_stops_generating_when_nothing_passes_the_filter(env, tmp_path):
    # Could fail if the round limit were not enforced: with a verifier no response can pass, every group is 0/G.
    (tmp_path / "never" / "never").mkdir(parents=True)
    (tmp_path / "never" / "never" / "task.py").write_text(
        PARITY.replace('NAME = "parity"', 'NAME = "never"').replace("ord(response[0]) % 2 == 0", "False"))
    cfg = config(env, algo="dapo", task="never", tasks_dirs=f"['{tmp_path / 'never'}']", steps=1,
                 task_options="{n: 64}")
    r = make_trainer(cfg).step(1)
    assert r.metrics["rollouts_fresh"] == 4 * B * G and r.metrics["x1"] == 0
    assert r.metrics["policy_version"] == 0  # an empty batch applies no update


def test_mini_test_mode_runs(env):
    # Could fail if the parameter-free preset broke the thresholds (c1 = 0, c2 = c3 = 1/2) or the trainer.
    trainer = make_trainer(config(env, algo="mini_test", steps=4))
    for t in range(1, 5):
        r = trainer.step(t)
        assert all(g.mu == 0 for g in trainer.state.bad.groups.values())
        assert all(g.mu == 0.5 for g in trainer.state.high.groups.values())
        assert all(g.mu == 0.5 for g in r.x3)
        assert all(0 < g.mu < 1 for g in r.x2)
        assert r.metrics["c2"] == r.metrics["c3"] == 0.5
        outside_x1 = set(trainer.state.bad.groups) - {g.uid for g in r.x1}
        assert r.reevaluated or not outside_x1  # reeval_every = 1: B_bad is revisited at every step


# --- 6. the run record of train() -------------------------------------------------------------------------------


def test_run_record_matches_the_metrics(recorded_run):
    # Could fail if prompt_steps rows were mislabelled (x1/filtered/x2/not_promoted/x3), a step were missing,
    # verdict counts did not cover every response scored, or checkpoints/final were not written.
    run = read_run(recorded_run)
    steps = run["steps"]
    assert [s["step"] for s in steps] == list(range(1, 9)) and run["meta"]["status"] == "finished"
    db = sqlite3.connect(recorded_run / "run.db")
    counts = {(t, sub): n for t, sub, n in
              db.execute("SELECT step, subset, COUNT(*) FROM prompt_steps GROUP BY step, subset")}
    verdicts = dict(db.execute("SELECT step, SUM(count) FROM verdicts GROUP BY step").fetchall())
    G_col = {g for (g,) in db.execute("SELECT DISTINCT G FROM prompt_steps")}
    db.close()
    assert G_col == {G}
    for s in steps:
        t = s["step"]
        n = lambda sub: counts.get((t, sub), 0)
        assert n("x1") == s["x1"] and n("x2") == s["x2"] and n("x3") == s["x3"]
        assert G * (n("x1") + n("filtered")) == s["rollouts_fresh"]
        assert G * (n("x2") + n("not_promoted")) == s["rollouts_reevaluated"]
        assert verdicts[t] == s["rollouts"] == s["rollouts_fresh"] + s["rollouts_reevaluated"]
        assert sum(s["bins"]) == n("x1") + n("filtered") and len(s["bins"]) == G + 1
    assert any(s["x2"] for s in steps) and any(s["x3"] for s in steps)  # every subset was exercised


def test_checkpoints_and_final_model(recorded_run, env):
    # Could fail if checkpoints were skipped or left half-written folders, if older ones were not pruned to the
    # newest keep_checkpoints=2 (step_3 gone), if a checkpoint held more than tensors and plain data (it would not
    # load with weights_only=True), or final/ held other weights than the trainer's last state (or could not be
    # loaded by transformers).
    ckpt = recorded_run / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_6", "step_8"]
    assert all((ckpt / f"step_{t}" / n).is_file() for t in (6, 8) for n in ("state.pt", "backend.pt"))
    state = torch.load(ckpt / "step_8" / "state.pt", weights_only=True)
    assert state["updates"] == read_run(recorded_run)["steps"][-1]["policy_version"]
    final = AutoModelForCausalLM.from_pretrained(recorded_run / "final")
    AutoTokenizer.from_pretrained(recorded_run / "final")
    trained = torch.load(ckpt / "step_8" / "backend.pt", weights_only=True)["policy"]
    assert all(torch.equal(v, trained[k]) for k, v in final.state_dict().items() if k in trained)
    initial = AutoModelForCausalLM.from_pretrained(env.model).state_dict()
    assert any(not torch.equal(v, initial[k]) for k, v in final.state_dict().items()), "training changed nothing"


# --- 7. a verifier that raises --------------------------------------------------------------------------------


def test_raising_verifier_counts_unparsable(env):
    # Could fail if an exception in verify() escaped the trainer, or were recorded as wrong/correct.
    trainer = make_trainer(config(env, task="parity_raises", steps=2))
    raised = 0
    for t in (1, 2):
        r = trainer.step(t)
        for g in r.fresh + r.reevaluated:
            for s in g.samples:
                assert s.verdict == parity_verdict(s.text, raises=True).value, s.text
                assert s.reward == (1.0 if s.verdict == "correct" else 0.0)
                raised += bool(s.text) and ord(s.text[0]) % 3 == 0
        assert sum(r.metrics["verdicts"].values()) == r.metrics["rollouts"]
    assert raised, "the verifier never raised: the test would prove nothing"


def test_raising_verifier_does_not_stop_train(env):
    # Could fail if train() (not only Trainer.step) let the exception through or marked the run failed.
    run_dir = train(config(env, task="parity_raises", name="raises", steps=2), quiet=True)
    run = read_run(run_dir)
    assert run["meta"]["status"] == "finished" and len(run["steps"]) == 2
    db = sqlite3.connect(run_dir / "run.db")
    unparsable = db.execute("SELECT SUM(count) FROM verdicts WHERE verdict = 'unparsable'").fetchone()[0]
    db.close()
    assert unparsable and unparsable > 0


# --- 8. bad configuration values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("override, words", [
    ("online_filter=foo", ["online_filter", "range", "gaussian", "uniform", "none"]),  # lists the choices
    ("promote=best", ["promote", "threshold", "improved"]),
    ("algo=ppo", ["algo", "grpo", "dapo"]),
    ("delay=0", ["delay"]),
    ("group_size=1", ["group_size"]),
    ("lr=fast", ["lr"]),
    ("no_such_key=1", ["no_such_key"]),
])
def test_bad_config_value_is_a_clear_error(override, words):
    # Could fail if a wrong value were accepted silently, or the error did not name the key and its choices.
    with pytest.raises((ValueError, KeyError)) as info:
        load_config(overrides=[override])
    assert all(w in str(info.value) for w in words), str(info.value)


def test_non_numeric_int_value_names_the_key():
    # Could fail if an int field were not type-checked when the config is built.
    with pytest.raises(ValueError, match="batch_size"):
        load_config(overrides=["batch_size=eight"])


# --- prompt sampling across an epoch boundary ------------------------------------------------------------------


def test_no_uid_twice_when_the_dataset_is_not_a_multiple_of_b(env):
    # Could fail if a batch took prompts from two epochs without removing repeats.
    trainer = make_trainer(config(env, task_options="{n: 12}", steps=3, **BAPO))
    for t in range(1, 4):
        r = trainer.step(t)
        fresh = [g.uid for g in r.fresh]
        batch = [g.uid for g in r.x1 + r.x2 + r.x3]
        assert len(fresh) == len(set(fresh)) and len(batch) == len(set(batch)), (t, fresh)


def test_train_completes_when_the_dataset_is_not_a_multiple_of_b(env):
    # Could fail if a batch straddling two epochs repeated a prompt (the record keys rows by step, uid, subset).
    run_dir = train(config(env, name="small-dataset", task_options="{n: 12}", steps=3, **BAPO), quiet=True)
    assert read_run(run_dir)["meta"]["status"] == "finished"


def test_ba_ppo_learns_a_critic_and_trains_on_its_gae(env, tmp_path, monkeypatch):
    # Could fail if the critic never saw a gradient, if the policy still got GRPO's per-group scalar advantage, if
    # the advantages the loss received were not GAE over the critic's values as they were before the update
    # (γ = λ = 1: A_t = r − V(s_t), whitened over the batch's valid tokens; computed here by hand, not by
    # gae_advantages), or if a checkpoint lost the critic.
    import bapo_vl.backends.embedded as embedded

    trainer = make_trainer(config(env, algo="ba_ppo", critic_lr=1e-3, **BAPO))  # one mini- and micro-batch
    backend = trainer.backend
    head = weights(backend.critic)
    seen, used = [], []
    update = backend.update
    backend.update = lambda batch: seen.append((batch, weights(backend.critic))) or update(batch)
    real_loss = embedded.total_loss
    monkeypatch.setattr(embedded, "total_loss", lambda logp, old, adv, *a, **k: used.append(adv.clone())
                        or real_loss(logp, old, adv, *a, **k))
    ms = [trainer.step(t).metrics for t in range(1, 5)]
    assert all(m["vf_loss"] > 0 for m in ms if m["trained_groups"])
    assert not same_weights(backend.critic, head)
    assert seen and all(b.advantages is None for b, _ in seen)  # the trainer left it to the critic
    batch, critic_before = seen[-1]
    rows = batch.sequences()
    prompts, tokens = [p for _, p, *_ in rows], [list(r.tokens) for _, _, r, *_ in rows]
    rewards = torch.tensor([w for *_, w, _ in rows])
    R = max(map(len, tokens))
    mask = torch.tensor([[1.0] * len(t) + [0.0] * (R - len(t)) for t in tokens])
    probe = make_trainer(config(env, algo="ba_ppo", **BAPO)).backend
    probe.critic.load_state_dict(critic_before)
    with torch.no_grad():
        values = probe._values(prompts, tokens, list(range(len(tokens)))).float()
    raw = (rewards[:, None] - values)[mask > 0]
    want = torch.zeros_like(mask)
    want[mask > 0] = (raw - raw.mean()) / (raw.var(unbiased=True) + 1e-8).sqrt()
    order = sorted(range(len(tokens)), key=lambda i: len(prompts[i]["input_ids"]) + len(tokens[i]))  # by length
    torch.testing.assert_close(used[-1].cpu(), want[order], atol=1e-4, rtol=1e-4)
    # a checkpoint keeps the critic, and a plain run's checkpoint is refused by a BA-PPO backend
    backend.save_checkpoint(tmp_path, 4)
    other = make_trainer(config(env, algo="ba_ppo", **BAPO)).backend
    other.load_checkpoint(tmp_path)
    assert same_weights(other.critic, weights(backend.critic))
    (tmp_path / "plain").mkdir()
    make_trainer(config(env, algo="bapo", **BAPO)).backend.save_checkpoint(tmp_path / "plain", 4)
    with pytest.raises(ValueError, match="no critic"):
        make_trainer(config(env, algo="ba_ppo", **BAPO)).backend.load_checkpoint(tmp_path / "plain")


def test_grpo_replay_refills_the_batch_with_mixed_groups_trained_on_before(env):
    # Could fail if the preset re-evaluated (X2), kept zero-variance groups, replayed a group twice in one batch, or
    # replayed something it had not trained on.
    cfg = config(env, algo="grpo_replay", steps=6)
    bapo = cfg.bapo
    assert (bapo.delay, bapo.online_filter, bapo.use_x2, bapo.use_x3) == (1, "range", False, True)
    assert bapo.high_max_uids == 64
    trainer = make_trainer(cfg)
    trained: set[str] = set()
    replayed_any = False
    for t in range(1, cfg.run.steps + 1):
        r = trainer.step(t)
        assert r.x2 == [] and r.reevaluated == []
        assert all(0 < g.correct < cfg.sampling.group_size for g in r.x1 + r.x3)  # zero-variance groups never train
        B = cfg.sampling.batch_size
        assert len(r.x1) + len(r.x3) <= B and len({g.uid for g in r.x1 + r.x3}) == len(r.x1) + len(r.x3)
        assert {g.uid for g in r.x3} <= trained
        if len(r.x1) < B and any(g.uid not in {x.uid for x in r.x1} for g in trainer.state.high.groups.values()):
            assert r.x3, f"step {t}: room in the batch and groups to replay, but none replayed"
        replayed_any |= bool(r.x3)
        trained |= {g.uid for g in r.x1 + r.x3}
    assert replayed_any, "the run never replayed: the test proves nothing"
