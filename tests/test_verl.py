"""BAPO on verl 0.9.1, on CPU: verl's real DataProto, GRPO advantage, RLHFDataset and padding helpers; our real
data conversion of the three tasks; and the SAME bapo_vl.trainer.Trainer driving VerlBackend and EmbeddedBackend.

Only verl's GPU workers are replaced, by stand-ins honouring their interfaces with real tensors from a tiny real
Qwen2 (bapo_vl.tiny) on CPU: the rollout manager (generate_sequences(DataProto) -> DataProto with prompts /
responses / response_mask / input_ids / attention_mask / position_ids / rollout_log_probs), the FSDP actor
(update_actor(DataProto): a real PPO step with our losses; save/restore_model_to_cpu as DetachActorWorker) and the
checkpoint engine manager (update_weights copies the actor's weights into the engine).

Rewards: the `scheduled` verifier below rewards by a seeded schedule per problem and call count, independent of the
sampled text, so two trainers that call the verifier in the same order see identical rewards (what "identical
rewards and seeds" means for two backends whose samplers differ).
"""
import copy
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from bapo_vl.backends.embedded import EmbeddedBackend
from bapo_vl.backends.verl_backend import (ALPHA, VerlBackend, VerlConfigError, object_array, trainable_groups,
                                           validate_verl_config)
from bapo_vl.backends import verl_data
from bapo_vl.config import load_config
from bapo_vl.losses import LossConfig, grpo_advantages, total_loss
from bapo_vl.plugins import get_task
from bapo_vl.problem import Problem, Verdict
from bapo_vl.tiny import build_qwen2
from bapo_vl.trainer import Trainer

from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures"
B, G = 6, 4


# --- verl's GRPO advantage vs ours --------------------------------------------------------------------------------

def test_grpo_advantage_matches_verl():
    gen = torch.Generator().manual_seed(0)
    rewards = (torch.rand(7, G, generator=gen) > 0.5).float()
    rewards[0] = 1.0  # all right: zero advantage in both
    R = 5
    lengths = torch.randint(1, R + 1, (7 * G,), generator=gen)
    mask = (torch.arange(R)[None] < lengths[:, None]).float()
    token_rewards = torch.zeros(7 * G, R)
    token_rewards[torch.arange(7 * G), lengths - 1] = rewards.flatten()
    index = np.array([f"g{i}" for i in range(7) for _ in range(G)], dtype=object)
    adv, _ = compute_grpo_outcome_advantage(token_rewards, mask, index, epsilon=1e-6)
    ours = grpo_advantages(rewards, eps=1e-6).flatten()
    # verl divides by (std + eps), ours by sqrt(std^2 + eps): equal up to eps-size terms where std > 0
    torch.testing.assert_close(adv[:, 0], ours, atol=2e-3, rtol=1e-3)
    assert torch.equal(adv, adv[:, :1] * mask)


# --- data conversion: three tasks ---------------------------------------------------------------------------------

def _problems(task: str, n: int = 3):
    t = get_task(task)
    if task == "countdown":
        return t.load(split="train", limit=n)
    if task == "math":
        return t.load(split="train", source=str(FIX / "math" / "train.json"), limit=n)
    return t.load(split="train", source=str(FIX / "geometry3k"), limit=n)


@pytest.mark.parametrize("task", ["countdown", "math", "geometry3k"])
def test_rows_parquet_and_rlhf_dataset_round_trip(task, tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from bapo_vl.tiny import build_processor, build_tokenizer

    problems = _problems(task)
    path = verl_data.write_parquet(problems, tmp_path / f"{task}.parquet", task)
    tok = build_tokenizer()
    processor = build_processor(tok) if task == "geometry3k" else None
    cfg = OmegaConf.create({"cache_dir": str(tmp_path / "cache"), "max_prompt_length": 100000,
                            "filter_overlong_prompts": False, "prompt_key": "prompt", "image_key": "images"})
    ds = RLHFDataset(str(path), tok, cfg, processor=processor)
    assert len(ds) == len(problems)
    for i, p in enumerate(problems):
        item = ds[i]
        assert item["data_source"] == f"bapo_vl/{task}" and item["reward_model"]["style"] == "rule"
        back = verl_data.row_to_problem(item)
        assert back.uid == p.uid and back.answer == p.answer and back.text == p.text
        assert len(back.images) == len(p.images)
        for a, b in zip(back.images, p.images):
            assert a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b.convert("RGB")))
        # the reward hook: our verifier, 0/1 accuracy
        score = verl_data.compute_score(item["data_source"], "nonsense", item["reward_model"]["ground_truth"],
                                        item["extra_info"])
        assert score["score"] == score["acc"] == 0.0 and score["verdict"] in ("wrong", "unparsable")


def test_geometry_reward_is_accuracy_not_shaped_score():
    p = _problems("geometry3k", 1)[0]
    row = verl_data.problem_to_row(p, "geometry3k", 0)
    gt = row["reward_model"]["ground_truth"]
    wrong = next(x for x in "ABCD" if x != p.answer["letter"])
    assert verl_data.compute_score(row["data_source"], f"<answer>{wrong}</answer>", gt)["score"] == 0.0  # not 0.1
    right = verl_data.compute_score(row["data_source"], f"<answer>{p.answer['letter']}</answer>", gt)
    assert right == {"score": 1.0, "acc": 1.0, "verdict": "correct"}


def test_dataproto_keeps_images_through_repeat_pad_concat():
    problems = _problems("geometry3k")
    rows = [verl_data.problem_to_row(p, "geometry3k", i) for i, p in enumerate(problems)]
    from bapo_vl.backends.verl_backend import build_raw_prompt
    from bapo_vl.tiny import build_processor

    raw = [build_raw_prompt(r, build_processor()) for r in rows]
    batch = DataProto.from_dict(tensors={"dummy_tensor": torch.zeros(3, 1)},
                                non_tensors={"raw_prompt": object_array(raw), "uid": object_array([p.uid for p in problems])})
    rep = batch.repeat(repeat_times=G, interleave=True)
    padded, pad = pad_dataproto_to_divisor(rep, 5)
    assert len(padded) % 5 == 0
    back = unpad_dataproto(DataProto.concat([padded[:7], padded[7:]]), pad)
    assert len(back) == 3 * G
    for i in range(len(back)):
        img = back.non_tensor_batch["raw_prompt"][i][0]["content"][0]["image"]
        src = problems[i // G].images[0]
        assert back.non_tensor_batch["uid"][i] == problems[i // G].uid
        assert np.array_equal(np.asarray(img), np.asarray(src.convert("RGB")))


# --- config validation and trimming -------------------------------------------------------------------------------

def test_config_validation_refuses_garbage_weights():
    with pytest.raises(VerlConfigError, match="free_cache_engine=False"):
        validate_verl_config("vllm", free_cache_engine=True, delay=5)
    with pytest.raises(VerlConfigError, match="SGLang"):
        validate_verl_config("sglang", free_cache_engine=False, delay=5)
    with pytest.raises(VerlConfigError, match="calculate_log_probs"):
        validate_verl_config("vllm", False, 5, calculate_log_probs=False)
    validate_verl_config("vllm", True, 1)  # on-policy: sleeping is harmless
    validate_verl_config("vllm", False, 5)


def test_trim_rule():
    assert trainable_groups(13, 8, 4, 8) == 12  # full mini-batches only
    assert trainable_groups(3, 8, 4, 8) == 3  # one smaller step: 24 % 8 == 0
    assert trainable_groups(3, 2, 4, 8) == 0  # 6, 4, 2 sequences: none splits over 8 ranks
    assert trainable_groups(3, 2, 4, 4) == 2


# --- stand-ins for verl's GPU workers -----------------------------------------------------------------------------

def _token_logprobs(model, input_ids, attention_mask, position_ids, R, temperature):
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, -R - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, -R:].unsqueeze(-1)).squeeze(-1)


class StandInRollout:
    """AgentLoopManager's interface: fixed prompt/response widths, left/right padding, rollout_log_probs."""

    def __init__(self, engine, tok, prompt_length, response_length, num_workers, temperature, seed):
        self.engine, self.tok = engine, tok
        self.prompt_length, self.response_length, self.num_workers = prompt_length, response_length, num_workers
        self.temperature = temperature
        self.gen = torch.Generator().manual_seed(seed)
        self.lengths = []

    @torch.no_grad()
    def generate_sequences(self, batch: DataProto) -> DataProto:
        from verl.utils.model import compute_position_id_with_mask

        assert len(batch) % self.num_workers == 0, "AgentLoopManager chunks the batch over its workers"
        self.lengths.append(len(batch))
        N, P, R = len(batch), self.prompt_length, self.response_length
        eos, pad = self.tok.eos_token_id, self.tok.pad_token_id
        prompts = torch.full((N, P), pad)
        pmask = torch.zeros(N, P, dtype=torch.long)
        for i, msgs in enumerate(batch.non_tensor_batch["raw_prompt"]):
            text = self.tok.apply_chat_template(list(msgs), add_generation_prompt=True, tokenize=False)
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            prompts[i, P - len(ids):], pmask[i, P - len(ids):] = torch.tensor(ids), 1
        responses = torch.full((N, R), pad)
        rmask = torch.zeros(N, R, dtype=torch.long)
        done = torch.zeros(N, dtype=torch.bool)
        for j in range(R):  # plain ancestral sampling with the engine's weights
            ids, mask = torch.cat([prompts, responses[:, :j]], 1), torch.cat([pmask, rmask[:, :j]], 1)
            logits = self.engine(input_ids=ids, attention_mask=mask,
                                 position_ids=compute_position_id_with_mask(mask)).logits[:, -1].float()
            nxt = torch.multinomial(torch.softmax(logits / self.temperature, -1), 1, generator=self.gen)[:, 0]
            responses[:, j] = torch.where(done, pad, nxt)
            rmask[:, j] = (~done).long()
            done |= nxt == eos
        input_ids, attn = torch.cat([prompts, responses], 1), torch.cat([pmask, rmask], 1)
        pos = compute_position_id_with_mask(attn)
        logp = _token_logprobs(self.engine, input_ids, attn, pos, R, self.temperature) * rmask
        return DataProto.from_dict(
            tensors={"prompts": prompts, "responses": responses, "response_mask": rmask, "input_ids": input_ids,
                     "attention_mask": attn, "position_ids": pos, "rollout_log_probs": logp},
            non_tensors=dict(batch.non_tensor_batch), meta_info={"timing": {}})


class StandInActor:
    """FSDP actor: update_actor = a real PPO step with our loss; DetachActorWorker's CPU snapshots; checkpoints."""

    def __init__(self, policy, cfg, dp_size):
        self.policy, self.cfg, self.dp_size = policy, cfg, dp_size
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.loss_cfg = LossConfig(name=cfg.loss, clip_low=cfg.clip_low, clip_high=cfg.clip_high, agg=cfg.loss_agg,
                                   kl_coef=0.0, entropy_coef=0.0)
        self.cpu_saved, self.batches = {}, []

    def update_actor(self, batch: DataProto) -> DataProto:
        assert len(batch) % self.dp_size == 0, "DP dispatch splits the batch evenly over the ranks"
        self.batches.append(batch)
        b = batch.batch
        logp = self.logprobs(self.policy, batch)
        self.optimizer.zero_grad()
        loss, metrics = total_loss(logp, b["old_log_probs"], b["advantages"], b["response_mask"].float(),
                                   self.loss_cfg, n_tokens=int(b["response_mask"].sum()), n_seqs=len(batch))
        loss.backward()
        self.optimizer.step()
        return DataProto(meta_info={"metrics": {"actor/pg_loss": [metrics["pg_loss"]]}})

    @staticmethod
    def logprobs(model, batch: DataProto):
        b = batch.batch
        return _token_logprobs(model, b["input_ids"], b["attention_mask"], b["position_ids"], b["responses"].shape[1],
                               batch.meta_info["temperature"])

    def save_model_to_cpu(self, n):
        self.cpu_saved[n] = copy.deepcopy(self.policy.state_dict())

    def restore_model_from_cpu(self, n):
        if n in self.cpu_saved:
            self.policy.load_state_dict(self.cpu_saved[n])

    def clear_cpu_model(self, n):
        self.cpu_saved.pop(n, None)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        Path(local_path).mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.policy.state_dict(), "optim": self.optimizer.state_dict()}, f"{local_path}/ckpt.pt")

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        state = torch.load(f"{local_path}/ckpt.pt")
        self.policy.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])


class StandInCheckpointManager:
    def __init__(self, actor, engine):
        self.actor, self.engine, self.steps = actor, engine, []

    def update_weights(self, global_steps=None):
        self.engine.load_state_dict(self.actor.policy.state_dict())
        self.steps.append(global_steps)


class ScheduledTask:
    """A task whose verifier rewards by a seeded schedule (problem, k-th call), not by the text."""

    name = "scheduled"

    def __init__(self, n=24):
        self.problems = [Problem(f"s-{i}", [{"role": "user", "content": f"q{i}"}], i) for i in range(n)]
        self.calls = {}

    def verify(self, text, answer):
        k = self.calls.get(answer, 0)
        self.calls[answer] = k + 1
        p = (answer % 6) / 5  # problems from always wrong to always right
        return Verdict.CORRECT if random.Random(f"{answer}-{k}").random() < p else Verdict.WRONG


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl")
    model, tok = build_qwen2(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root / "model"


BAPO = dict(c1=0.25, reeval_every=2, c2_range="[0.0, 0.0]", c3_range="[1.0, 1.0]", delay=3)


def make_cfg(model_dir, **kw):
    values = dict(task="countdown", model=model_dir, device="cpu", dtype="float32", batch_size=B, group_size=G,
                  max_prompt_length=64, max_response_length=4, mini_batch_size=B, micro_batch_size=64, lr=1e-3,
                  kl_coef=0.0, entropy_coef=0.0, seed=3, **BAPO)
    values.update(kw)
    return load_config(overrides=[f"{k}={v}" for k, v in values.items()])


def make_verl(cfg, dp_size=2, num_workers=4, mini_batch_size=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model)
    policy = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).eval()
    engine = copy.deepcopy(policy)
    actor = StandInActor(policy, cfg, dp_size)
    rollout = StandInRollout(engine, tok, cfg.max_prompt_length, cfg.max_response_length, num_workers,
                             cfg.temperature, cfg.seed)
    ckpt = StandInCheckpointManager(actor, engine)
    backend = VerlBackend(cfg, rollout, actor, ckpt, tok, task_name="scheduled", divisor=num_workers,
                          dp_size=dp_size, mini_batch_size=mini_batch_size)
    return backend


def uids(result):
    return ([g.uid for g in result.x1], [g.uid for g in result.reevaluated], [g.uid for g in result.x2],
            [g.uid for g in result.x3])


def weights(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def same(m, snap):
    return all(torch.equal(v, snap[k]) for k, v in m.state_dict().items())


T = 7


@pytest.fixture(scope="module")
def runs(model_dir):
    """The same Trainer, T steps, over the embedded backend and over VerlBackend with stand-in workers."""
    cfg = make_cfg(model_dir)
    task_e, task_v = ScheduledTask(), ScheduledTask()
    emb = Trainer(cfg, EmbeddedBackend(cfg), task_e, task_e.problems)
    backend = make_verl(cfg)
    ver = Trainer(cfg, backend, task_v, task_v.problems)
    out = {"emb": [], "ver": [], "alpha_ok": [], "calls_per_step": []}
    for t in range(1, T + 1):
        out["emb"].append(emb.step(t))
        n_calls = len(backend.calls)
        out["ver"].append(ver.step(t))
        out["calls_per_step"].append(backend.calls[n_calls:])
        # after every step the engine holds alpha = the actor as it was at the last sync
        out["alpha_ok"].append(same(backend.rollout_manager.engine, backend.actor.cpu_saved[ALPHA]))
    return out, emb, ver, backend


def test_same_x1_x2_x3_as_embedded_backend(runs):
    out, emb, ver, _ = runs
    for t, (a, b) in enumerate(zip(out["emb"], out["ver"]), 1):
        assert uids(a) == uids(b), f"step {t}"
    total = lambda k: sum(len(getattr(r, k)) for r in out["ver"])
    assert total("x1") and total("x2") and total("x3"), "all three sources must have work in this test"
    assert [g.uid for g in emb.state.bad.groups.values()] == [g.uid for g in ver.state.bad.groups.values()]
    assert emb.state.thresholds.r_tot == ver.state.thresholds.r_tot
    assert emb.updates == ver.updates == T


def test_update_batch_carries_stored_behaviour_logprobs(runs):
    out, _, ver, backend = runs
    assert len(backend.actor.batches) == T
    for r, batch in zip(out["ver"], backend.actor.batches):
        groups = r.x1 + r.x2 + r.x3
        samples = [s for g in groups for s in g.samples]
        b = batch.batch
        assert len(batch) == len(samples) and len(batch) % backend.dp_size == 0
        for i, s in enumerate(samples):
            m = b["response_mask"][i].bool()
            assert b["responses"][i][m].tolist() == s.tokens
            assert torch.equal(b["old_log_probs"][i][m], torch.tensor(s.logprobs, dtype=torch.float32))
            assert torch.all(b["advantages"][i][~m] == 0)
        # token-level advantages are our GRPO advantages per group, constant over each response
        adv = grpo_advantages(torch.tensor([g.rewards for g in groups]), eps=1e-6).flatten()
        torch.testing.assert_close(b["advantages"][:, 0], adv)
    # replayed (X3) groups: the log-probs are those stored when they were generated, steps earlier
    assert any(g.step < r.metrics["step"] for r in out["ver"] for g in r.x3)


def test_behaviour_logprobs_are_the_engines(runs, model_dir):
    # the rollout_log_probs stored are those of the engine weights (alpha) that sampled the tokens
    out, _, _, backend = runs
    cfg = make_cfg(model_dir)
    fresh = make_verl(cfg)  # untrained: step 1 and 2 sampled with the initial weights (no sync before t=3)
    g = out["ver"][0].fresh[0]
    s = g.samples[0]
    enc = fresh.encode(g.problem)
    ids = torch.cat([enc["input_ids"], torch.tensor(s.tokens)])[None]
    mask = torch.ones_like(ids)
    logp = _token_logprobs(fresh.actor.policy, ids, mask, (mask.cumsum(-1) - 1), len(s.tokens), cfg.temperature)
    torch.testing.assert_close(logp[0], torch.tensor(s.logprobs), atol=1e-5, rtol=1e-4)


def test_sync_schedule_and_reevaluation_dance(runs):
    out, _, _, backend = runs
    v, m = BAPO["delay"], BAPO["reeval_every"]
    for t, (calls, r) in enumerate(zip(out["calls_per_step"], out["ver"]), 1):
        kinds = [c[0] for c in calls]
        expect = ["sync"] if t % v == 0 else []
        if r.reevaluated and t % v != 0:  # at t % v == 0 the engine was just synced: it already holds pi_theta
            expect += ["reeval_sync", "reeval_restore"]
        assert kinds == expect, f"step {t}: {calls}"
        assert (t % m == 0) or not r.reevaluated
    assert all(out["alpha_ok"])
    assert any(r.reevaluated for r in out["ver"])
    # every batch sent to the engine was padded to the divisor
    assert all(n % backend.divisor == 0 for n in backend.rollout_manager.lengths)


def test_resume_round_trip(model_dir, tmp_path):
    cfg = make_cfg(model_dir)
    task = ScheduledTask()
    a_backend = make_verl(cfg)
    a = Trainer(cfg, a_backend, task, task.problems)
    for t in range(1, 5):
        a.step(t)
    state = copy.deepcopy(a.state_dict())
    task_copy = copy.deepcopy(task)
    a_backend.save_checkpoint(tmp_path / "ck", 4)
    alpha = weights(a_backend.rollout_manager.engine)
    cont = [uids(a.step(t)) for t in (5, 6)]

    b_backend = make_verl(cfg)
    b = Trainer(cfg, b_backend, task_copy, task_copy.problems)
    b.load_state_dict(state)
    b_backend.load_checkpoint(tmp_path / "ck")
    assert same(b_backend.rollout_manager.engine, alpha)  # the stale alpha is back in the engine
    assert same(b_backend.actor.policy, torch.load(tmp_path / "ck" / "actor" / "ckpt.pt")["model"])
    assert [uids(b.step(t)) for t in (5, 6)] == cont


def test_batch_trimmed_for_data_parallel(model_dir):
    cfg = make_cfg(model_dir, use_x2="false", use_x3="false")
    task = ScheduledTask()
    backend = make_verl(cfg, dp_size=8, mini_batch_size=2)  # G=4: two groups per 8 sequences
    tr = Trainer(cfg, backend, task, task.problems)
    for t in range(1, 4):
        r = tr.step(t)
        n = len(r.x1 + r.x2 + r.x3)
        keep = trainable_groups(n, G, 2, 8)
        assert r.metrics["trimmed_groups"] == n - keep
        if keep:
            assert len(backend.actor.batches[-1]) == keep * G


def test_verl_main_imports():
    import bapo_vl.backends.verl_main as vm

    assert callable(vm.main) and callable(vm.build_verl_workers)


@pytest.mark.parametrize("task", ["math", "countdown", "geometry3k"])
def test_presets_compose_with_verls_real_config(task):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import ActorConfig

    from bapo_vl.backends.verl_main import derived_settings, load_configs

    cfg, vcfg = load_configs(str(ROOT / "bapo_vl" / "presets" / f"verl_{task}.yaml"),
                             ["bapo.delay=3", "bapo.loss=balanced_clip", "bapo.lr=3e-6", "verl.trainer.nnodes=2"])
    paper = load_config(task)  # the verl preset starts from our paper preset
    assert (cfg.task, cfg.model, cfg.batch_size, cfg.max_response_length) == \
        (task, paper.model, paper.batch_size, paper.max_response_length)
    assert cfg.delay == 3 and cfg.lr == 3e-6 and vcfg.trainer.nnodes == 2
    r, a = vcfg.actor_rollout_ref.rollout, vcfg.actor_rollout_ref.actor
    assert r.free_cache_engine is False and r.calculate_log_probs is True and r.n == cfg.group_size
    assert vcfg.actor_rollout_ref.model.path == cfg.model and r.response_length == cfg.max_response_length
    assert a.optim.lr == 3e-6 and a.policy_loss.loss_mode == "bapo_balanced_clip"
    assert a.kl_loss_coef == cfg.kl_coef and a.use_kl_loss is (cfg.kl_coef > 0) and a.entropy_coeff == cfg.entropy_coef
    for key, (_, value) in derived_settings(cfg).items():
        node = vcfg
        for part in key.split("."):
            node = node[part]
        assert node == value, key
    validate_verl_config(r.name, r.free_cache_engine, cfg.delay)
    assert vcfg.reward.custom_reward_function.name == "compute_score" and vcfg.trainer.use_v1 is False
    actor = omega_conf_to_dataclass(a)  # as verl's actor worker builds it; its own checks accept it
    actor.validate(n_gpus=8, train_batch_size=cfg.batch_size)
    assert isinstance(actor, ActorConfig) and actor.clip_ratio_low == cfg.clip_low and actor.loss_agg_mode == cfg.loss_agg


def test_verl_overrides_of_our_settings_are_refused():
    from bapo_vl.backends.verl_main import load_configs

    preset = str(ROOT / "bapo_vl" / "presets" / "verl_math.yaml")
    with pytest.raises(ValueError, match=r"use bapo\.lr instead"):
        load_configs(preset, ["verl.actor_rollout_ref.actor.optim.lr=1e-5"])
    with pytest.raises(ValueError, match="fixed by BAPO"):
        load_configs(preset, ["verl.actor_rollout_ref.rollout.calculate_log_probs=false"])


def test_verl_discovers_our_loss_plugin_on_import():
    """A fresh interpreter (as a Ray worker is): `import verl` alone registers bapo_balanced_clip."""
    import subprocess
    import sys

    code = ("import verl\nfrom verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
            "print(get_policy_loss_fn('bapo_balanced_clip').__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "bapo_vl.backends.verl_loss"


@pytest.mark.parametrize("loss,extra", [("ppo_clip", []), ("ppo_clip", ["bapo.dual_clip=3.0"]),
                                        ("ppo_clip", ["bapo.clip_high=0.28", "bapo.loss_agg=seq-mean-token-mean"]),
                                        ("gspo", ["bapo.loss_agg=seq-mean-token-mean"]),
                                        ("balanced_clip", ["bapo.bac_target=0.6", "bapo.bac_clip_low_range=[0.5,0.9]"])])
def test_verl_actor_computes_our_loss(loss, extra, monkeypatch):
    """The policy loss verl's actor computes from the derived config equals ours on the same tensors."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    from bapo_vl.backends import verl_loss
    from bapo_vl.backends.verl_main import load_configs
    from bapo_vl.losses import aggregate, get_policy_loss

    cfg, vcfg = load_configs(str(ROOT / "bapo_vl" / "presets" / "verl_math.yaml"), [f"bapo.loss={loss}", *extra])
    monkeypatch.setenv(verl_loss.ENV, verl_loss.env_value(cfg))
    actor = omega_conf_to_dataclass(vcfg.actor_rollout_ref.actor)
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=gen, dtype=torch.float64) * 3
    logp = old + torch.randn(6, 9, generator=gen, dtype=torch.float64) * 0.6
    adv = torch.randn(6, 1, generator=gen, dtype=torch.float64).expand(6, 9)
    mask = (torch.arange(9)[None] < torch.tensor([[9], [7], [3], [9], [1], [5]])).double()
    ours_mat, _ = get_policy_loss(cfg.loss)(logp, old, adv, mask, cfg.loss_config())
    ours = aggregate(ours_mat, mask, cfg.loss_agg)
    theirs, _ = get_policy_loss_fn(actor.policy_loss.loss_mode)(old_log_prob=old, log_prob=logp, advantages=adv,
                                                              response_mask=mask.bool(), loss_agg_mode=actor.loss_agg_mode,
                                                              config=actor)
    torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=1e-8)


# --- Qwen2.5-VL update batches: M-RoPE positions as verl's agent loop computes them -------------------------------

def test_vl_update_batch_positions_match_the_models_own(tmp_path):
    """Two Geometry3K diagrams of different sizes (so the prompts are left-padded differently): the update batch's
    (N, 4, L) position ids (text row + M-RoPE rows, from verl's code over verl's `hf_processor`) give the same logits
    as the Qwen2.5-VL model computing its rope index itself; images_seqlens and global_token_num ride along."""
    from transformers import AutoTokenizer
    from verl.utils import hf_processor

    from bapo_vl.tiny import build_qwen2_5_vl

    model, processor = build_qwen2_5_vl(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    proc = hf_processor(str(tmp_path / "vl"))
    tok = AutoTokenizer.from_pretrained(tmp_path / "vl")
    cfg = make_cfg(tmp_path / "vl", task="geometry3k", max_prompt_length=4096, use_x2="false")
    backend = VerlBackend(cfg, None, None, None, tok, proc, task_name="geometry3k")
    problems = [p for p in _problems("geometry3k", 40)]
    first = problems[0]
    other = next(p for p in problems if p.images[0].size != first.images[0].size)
    enc = [backend.encode(p) for p in (first, other)]
    assert len(enc[0]["input_ids"]) != len(enc[1]["input_ids"])
    responses = [[tok.convert_tokens_to_ids(c) for c in "<answer>B"], [tok.convert_tokens_to_ids(c) for c in "A"]]
    seqs = [{"prompt": e, "tokens": r, "logprobs": [-0.5] * len(r), "advantage": 1.0, "group": i}
            for i, (e, r) in enumerate(zip(enc, responses))]
    batch = backend.sequences_to_dataproto(seqs)
    pos, ids, mask = batch.batch["position_ids"], batch.batch["input_ids"], batch.batch["attention_mask"]
    assert pos.shape == (2, 4, ids.shape[1])
    mm = batch.non_tensor_batch["multi_modal_inputs"]
    assert all("mm_token_type_ids" not in m for m in mm)
    image_pad = tok.convert_tokens_to_ids("<|image_pad|>")
    merge = proc.image_processor.merge_size ** 2
    for i in range(2):  # images_seqlens counts vision-encoder patches (before the merge), as in verl
        assert int(mm[i]["images_seqlens"].sum()) == merge * int((ids[i] == image_pad).sum()) > 0
    assert batch.meta_info["images_seqlens"] == [int(m["images_seqlens"].sum()) for m in mm]
    assert batch.meta_info["global_token_num"] == mask.sum(-1).tolist()
    with torch.no_grad():
        for i in range(2):
            inputs = dict(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1], pixel_values=mm[i]["pixel_values"],
                          image_grid_thw=mm[i]["image_grid_thw"])
            ours = model(**inputs, position_ids=pos[i:i + 1].transpose(0, 1)).logits[0][mask[i].bool()]
            own = model(**inputs, mm_token_type_ids=(ids[i:i + 1] == image_pad).int()).logits[0][mask[i].bool()]
            text_only = model(**inputs, position_ids=pos[i:i + 1, 0]).logits[0][mask[i].bool()]
            err, text_err = (ours - own).abs().max().item(), (text_only - own).abs().max().item()
            print(f"max |ours - own| {err:.2e}, max |text-only positions - own| {text_err:.2e}")
            assert err < 1e-5 and text_err > 100 * err  # the M-RoPE rows matter, and ours are the model's


class VLStandInRollout:
    """AgentLoopManager for Qwen2.5-VL: each row's raw_prompt (PIL images inside) through verl's own
    process_vision_info (as its agent loop does) and the processor, ancestral
    sampling with the engine (the model computes its own M-RoPE positions), rollout_log_probs of the sampled tokens."""

    def __init__(self, engine, processor, response_length, temperature, seed):
        self.engine, self.processor, self.R, self.temperature = engine, processor, response_length, temperature
        self.gen = torch.Generator().manual_seed(seed)
        self.image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.patch = processor.image_processor.patch_size
        self.vision = torch.tensor([engine.config.image_token_id, engine.config.video_token_id])

    @torch.no_grad()
    def generate_sequences(self, batch: DataProto) -> DataProto:
        import asyncio

        from verl.utils.dataset.rl_dataset import RLHFDataset

        tok = self.processor.tokenizer
        prompts, responses, logps = [], [], []
        for msgs in batch.non_tensor_batch["raw_prompt"]:
            images = asyncio.run(RLHFDataset.process_vision_info(list(msgs), self.patch, config=None))[0]
            text = self.processor.apply_chat_template(list(msgs), add_generation_prompt=True, tokenize=False)
            enc = self.processor(text=[text], images=images, return_tensors="pt")
            ids, resp, lp = enc["input_ids"], [], []
            for _ in range(self.R):
                logits = self.engine(input_ids=ids, pixel_values=enc["pixel_values"],
                                     image_grid_thw=enc["image_grid_thw"],
                                     mm_token_type_ids=(ids == self.image_pad).int()).logits[0, -1].float()
                dist = torch.log_softmax(logits / self.temperature, -1)
                # never sample <|image_pad|> / <|video_pad|> (a random model would; they break the M-RoPE index, in
                # verl too); the
                # log-probs stay the model's raw ones (vLLM's default logprobs_mode, and the embedded backend's)
                nxt = torch.multinomial(dist.exp().index_fill(0, self.vision, 0), 1,
                                        generator=self.gen)
                resp.append(int(nxt))
                lp.append(float(dist[nxt]))
                ids = torch.cat([ids, nxt[None]], 1)
                if int(nxt) == tok.eos_token_id:
                    break
            prompts.append(enc["input_ids"][0])
            responses.append(resp)
            logps.append(lp)
        N, P = len(prompts), max(len(p) for p in prompts)
        out = {"prompts": torch.full((N, P), tok.pad_token_id), "responses": torch.full((N, self.R), tok.pad_token_id),
               "attention_mask": torch.zeros(N, P + self.R, dtype=torch.long),
               "rollout_log_probs": torch.zeros(N, self.R)}
        for i, (p, r, lp) in enumerate(zip(prompts, responses, logps)):
            out["prompts"][i, P - len(p):] = p
            out["responses"][i, :len(r)] = torch.tensor(r)
            out["attention_mask"][i, P - len(p):P + len(r)] = 1
            out["rollout_log_probs"][i, :len(r)] = torch.tensor(lp)
        return DataProto.from_dict(tensors=out, non_tensors=dict(batch.non_tensor_batch))


class VLStandInActor(StandInActor):
    """The FSDP actor on Qwen2.5-VL update batches: per sequence, the batch's (4, L) position ids and its
    multi_modal_inputs (pixel_values, image_grid_thw) exactly as verl's actor feeds them to the model."""

    @staticmethod
    def logprobs(model, batch: DataProto):
        b, mm = batch.batch, batch.non_tensor_batch["multi_modal_inputs"]
        R = b["responses"].shape[1]
        rows = []
        for i in range(len(batch)):
            logits = model(input_ids=b["input_ids"][i:i + 1], attention_mask=b["attention_mask"][i:i + 1],
                           position_ids=b["position_ids"][i:i + 1].transpose(0, 1),
                           pixel_values=mm[i]["pixel_values"], image_grid_thw=mm[i]["image_grid_thw"]).logits
            logits = logits[:, -R - 1:-1].float() / batch.meta_info["temperature"]
            rows.append(torch.log_softmax(logits, -1).gather(-1, b["input_ids"][i:i + 1, -R:, None])[..., 0])
        return torch.cat(rows)


def test_qwen2_5_vl_trains_through_verl_backend(tmp_path):
    """The Trainer over VerlBackend on real Geometry3K diagrams with a tiny Qwen2.5-VL: every update batch,
    replayed (X3) groups included, reproduces the engine's behaviour log-probs from its own position ids and
    images, and the update reaches the vision tower."""
    import dataclasses

    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from verl.utils import hf_processor

    from bapo_vl.tiny import build_qwen2_5_vl

    model, processor = build_qwen2_5_vl(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64,
                                        max_pixels=112 * 112)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    proc = hf_processor(str(tmp_path / "vl"))
    tok = AutoTokenizer.from_pretrained(tmp_path / "vl")
    # delay larger than the run: the engine keeps the initial weights, so every stored log-prob is theirs
    cfg = make_cfg(tmp_path / "vl", task="geometry3k", max_prompt_length=4096, use_x2="false", delay=100,
                   batch_size=4, mini_batch_size=4)
    task = ScheduledTask(0)
    task.problems = [dataclasses.replace(p, answer=i) for i, p in enumerate(_problems("geometry3k", 12))]
    load = lambda: Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "vl", dtype=torch.float32).eval()
    policy, engine = load(), load()
    actor = VLStandInActor(policy, cfg, dp_size=1)
    backend = VerlBackend(cfg, VLStandInRollout(engine, proc, cfg.max_response_length, cfg.temperature, cfg.seed),
                          actor, StandInCheckpointManager(actor, engine), tok, proc, task_name="geometry3k")
    tr = Trainer(cfg, backend, task, task.problems)
    vision_before = weights(policy.model.visual)
    results = [tr.step(t) for t in range(1, 5)]
    assert sum(len(r.x3) for r in results) > 0 and len(actor.batches) == 4
    with torch.no_grad():
        for batch in actor.batches:
            assert batch.batch["position_ids"].shape[1] == 4
            m = batch.batch["response_mask"].bool()
            ours = VLStandInActor.logprobs(engine, batch)
            # ~1e-6 here; text-only positions in the M-RoPE rows give ~2e-5
            torch.testing.assert_close(ours[m], batch.batch["old_log_probs"][m], atol=5e-6, rtol=0)
    assert not same(policy.model.visual, vision_before)


def test_ba_ppo_is_refused_on_verl(model_dir):
    with pytest.raises(VerlConfigError, match="BA-PPO"):
        make_verl(make_cfg(model_dir, critic="true"))
