"""BAPO on verl 0.9.1, on CPU: verl's real DataProto, GRPO advantage, RLHFDataset and padding helpers; our real
data conversion of the three tasks; and the SAME bapo_vl.trainer.Trainer driving VerlBackend and EmbeddedBackend.

Only verl's GPU workers are replaced, by stand-ins honouring their interfaces with real tensors from a tiny real
Qwen2 (bapo_vl.tiny) on CPU: the rollout manager (generate_sequences(DataProto) -> DataProto with prompts /
responses / response_mask / input_ids / attention_mask / position_ids / rollout_log_probs), the FSDP actor
(update_actor(DataProto): real PPO mini-batch steps with verl's own policy loss, agg_loss and kl_penalty, configured
by verl's ActorConfig composed from our Config, metrics named and renamed as verl's actor path does;
save/restore_model_to_cpu as DetachActorWorker; a reference policy) and the checkpoint engine manager (update_weights
copies the actor's weights into the engine).

Rewards: the `scheduled` verifier below rewards by a seeded schedule per problem and call count, independent of the
sampled text, so two trainers that call the verifier in the same order see identical rewards (what "identical
rewards and seeds" means for two backends whose samplers differ).
"""
import copy
import functools
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from bapo_vl.backends.base import UPDATE_METRICS, Response, UpdateBatch
from bapo_vl.backends.verl_backend import (ALPHA, COUNTED, VERL_METRICS, VerlBackend, VerlConfigError, object_array,
                                           trainable_groups, validate_verl_config)
from bapo_vl.backends import verl_data
from bapo_vl.config import load_config
from bapo_vl.losses import grpo_advantages
from bapo_vl.plugins import get_task
from bapo_vl.problem import Problem, Verdict
from bapo_vl.tiny import build_qwen2
from bapo_vl.train import make_backend, make_trainer

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
    # verl asserts whole micro-batches per rank: 15 groups of 8 under a mini-batch of 16 prompts, micro 16 -> 14
    # (112 sequences = 7 micro-batches); with micro 64 only 8 groups (one micro-batch) remain
    assert trainable_groups(15, 8, 16, 1, 16) == 14 and trainable_groups(15, 8, 16, 1, 64) == 8
    assert trainable_groups(15, 8, 16, 2, 16) == 12  # 96 sequences: 48 per rank, 3 micro-batches each


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


@functools.cache
def _verl_base_config():
    """verl's ppo_trainer config with the `verl:` part of our verl_countdown preset (how verl runs: strategy,
    micro-batch size, engine), composed by Hydra as verl_launch.compose does."""
    import yaml
    from hydra import compose, initialize_config_dir

    import verl

    preset = yaml.safe_load((ROOT / "bapo_vl" / "presets" / "verl_countdown.yaml").read_text())
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        return compose(config_name="ppo_trainer", overrides=[f"{k}={v}" for k, v in preset["verl"].items()])


def verl_config(cfg):
    """verl's config for our Config `cfg`, as verl_launch.compose writes it: every derived setting in place."""
    from omegaconf import OmegaConf

    from bapo_vl.verl_launch import derived_settings

    vcfg = copy.deepcopy(_verl_base_config())
    OmegaConf.set_struct(vcfg, False)
    for key, (_, value) in derived_settings(cfg).items():
        OmegaConf.update(vcfg, key, value, merge=False)
    return vcfg


class StandInActor:
    """verl's actor side as VerlBackend calls it (verl_backend.RayTrainerActor: RayPPOTrainer._update_actor over the
    engine worker's update_actor), on CPU, configured by verl's own ActorConfig composed from our Config:

      update_actor  per mini-batch of ppo_mini_batch_size * rollout.n sequences (one micro-batch each, ppo_epochs
                    times): what verl.workers.utils.losses.ppo_loss computes, with verl's own policy-loss function,
                    agg_loss and kl_penalty; gradient clip at optim.clip_grad (what verl's FSDP engine clips with);
                    optimizer step. Its metrics take verl's path: the worker's dict (the policy loss's own actor/...
                    names, actor/pg_loss, actor/entropy_loss, kl_loss, kl_coef, loss, grad_norm, lr on the last
                    mini-batch, mfu) -> append_to_dict over mini-batches (engine_workers.update_actor) ->
                    rename_dict(..., "actor/") and perf/mfu/actor (RayPPOTrainer._update_actor).
      DetachActorWorker's CPU snapshots, compute_ref_log_prob (a frozen copy of the initial weights), checkpoints."""

    def __init__(self, policy, cfg, dp_size, mini_batch_size=None):
        from verl.utils.config import omega_conf_to_dataclass

        self.policy, self.cfg, self.dp_size = policy, cfg, dp_size
        self.vcfg = verl_config(cfg)
        self.config = omega_conf_to_dataclass(self.vcfg.actor_rollout_ref.actor)
        self.mini_batch_size = mini_batch_size or self.config.ppo_mini_batch_size  # prompts per optimizer step
        self.ref = copy.deepcopy(policy).eval() if self.config.use_kl_loss else None
        optim = self.config.optim
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=optim.lr, weight_decay=optim.weight_decay,
                                           betas=tuple(optim.betas))
        self.cpu_saved, self.batches, self.metrics = {}, [], []
        self.profiled = []  # ("start", step) / ("update", n) / ("stop", last), as verl's worker group sees them

    def start_profile(self, step):
        self.profiled.append(("start", step))

    def stop_profile(self, last):
        self.profiled.append(("stop", last))

    def update_actor(self, batch: DataProto) -> DataProto:
        from verl.utils.py_functional import append_to_dict, rename_dict

        assert len(batch) % self.dp_size == 0, "DP dispatch splits the batch evenly over the ranks"
        self.batches.append(batch)
        a = self.config
        calculate_entropy = a.calculate_entropy or a.entropy_coeff != 0.0  # as RayPPOTrainer._update_actor
        minis = [m for _ in range(a.ppo_epochs)
                 for m in batch.split(self.mini_batch_size * self.vcfg.actor_rollout_ref.rollout.n)]
        worker: dict = {}
        for i, mini in enumerate(minis):
            append_to_dict(worker, self.train_batch(mini, calculate_entropy, last=i == len(minis) - 1))
        metrics = rename_dict(worker, "actor/")  # RayPPOTrainer._update_actor, from here on verbatim
        metrics["perf/mfu/actor"] = metrics.pop("actor/mfu")
        self.metrics.append(metrics)
        return DataProto.from_single_dict(data={}, meta_info={"metrics": metrics})

    def train_batch(self, mini: DataProto, calculate_entropy: bool, last: bool) -> dict:
        """One optimizer step; the worker-level metrics of verl's ppo_loss + _postprocess_output (plain floats:
        one micro-batch, so verl's Metric aggregation is the value itself)."""
        from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty

        a, b = self.config, mini.batch
        mask = b["response_mask"].bool()
        logp, entropy = self.forward(self.policy, mini, with_entropy=calculate_entropy)
        pg_loss, pg_metrics = get_policy_loss_fn(a.policy_loss.loss_mode)(
            old_log_prob=b["old_log_probs"], log_prob=logp, advantages=b["advantages"], response_mask=mask,
            loss_agg_mode=a.loss_agg_mode, config=a, rollout_is_weights=b.get("rollout_is_weights", None))
        metrics = {k: float(v) for k, v in pg_metrics.items()} | {"actor/pg_loss": pg_loss.item()}
        loss = pg_loss
        if entropy is not None:
            entropy_loss = agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=a.loss_agg_mode)
            loss = loss - a.entropy_coeff * entropy_loss
            metrics["actor/entropy_loss"] = entropy_loss.item()
        if a.use_kl_loss:
            kld = kl_penalty(logprob=logp, ref_logprob=b["ref_log_prob"], kl_penalty=a.kl_loss_type)
            kl_loss = agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=a.loss_agg_mode)
            loss = loss + kl_loss * a.kl_loss_coef
            metrics["kl_loss"], metrics["kl_coef"] = kl_loss.item(), a.kl_loss_coef
        self.optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), a.optim.clip_grad)
        self.optimizer.step()
        metrics["loss"], metrics["grad_norm"] = loss.item(), grad_norm.item()
        if last:  # the engine steps its lr scheduler after the last mini-batch and reports that lr
            metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["mfu"] = 0.0  # no flops counter on CPU; RayPPOTrainer._update_actor pops the key, so it must be there
        metrics["perf/max_memory_reserved_gb"] = 2.5  # GiB, under verl's name; on CPU there is no torch peak to give
        return metrics

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        """RayPPOTrainer._compute_ref_log_prob: ref_log_prob (float) under the reference policy."""
        return DataProto.from_dict(tensors={"ref_log_prob": self.logprobs(self.ref, batch).float()})

    @staticmethod
    def response_logits(model, batch: DataProto):
        """(N, R, V) logits of the response tokens at the batch's temperature, as verl's actor scales them."""
        b = batch.batch
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits
        return logits[:, -b["responses"].shape[1] - 1:-1].float() / batch.meta_info["temperature"]

    @classmethod
    def forward(cls, model, batch: DataProto, with_entropy=False):
        """(log-probs of the response tokens, their entropy or None), each (N, R)."""
        from verl.utils.torch_functional import entropy_from_logits

        logits = cls.response_logits(model, batch)
        ids = batch.batch["input_ids"][:, -logits.shape[1]:]
        logp = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        return logp, entropy_from_logits(logits) if with_entropy else None

    @classmethod
    def logprobs(cls, model, batch: DataProto):
        return cls.forward(model, batch)[0]

    def save_model_to_cpu(self, n):
        self.cpu_saved[n] = copy.deepcopy(self.policy.state_dict())

    def restore_model_from_cpu(self, n):
        if n in self.cpu_saved:
            self.policy.load_state_dict(self.cpu_saved[n])

    def clear_cpu_model(self, n):
        self.cpu_saved.pop(n, None)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        """The files verl's FSDP checkpoint manager writes at world size 1 (what verl's model merger reads):
        model / optimizer shards, fsdp_config.json and the Hugging Face config + tokenizer in huggingface/."""
        import json

        from transformers import AutoTokenizer

        root = Path(local_path)
        (root / "huggingface").mkdir(parents=True, exist_ok=True)
        torch.save(self.policy.state_dict(), root / "model_world_size_1_rank_0.pt")
        torch.save(self.optimizer.state_dict(), root / "optim_world_size_1_rank_0.pt")
        (root / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
        self.policy.config.save_pretrained(root / "huggingface")
        AutoTokenizer.from_pretrained(self.cfg.run.model).save_pretrained(root / "huggingface")

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        self.policy.load_state_dict(torch.load(Path(local_path) / "model_world_size_1_rank_0.pt"))
        self.optimizer.load_state_dict(torch.load(Path(local_path) / "optim_world_size_1_rank_0.pt"))


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

    def load(self, split="train", **options):  # what bapo_vl.train.train asks of a task
        return self.problems

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


def verl_backend(cfg, *workers, **options):
    """A VerlBackend over (stand-in) workers, given the groups of cfg it reads, as verl_launch.make_verl_backend."""
    return VerlBackend(cfg.sampling, cfg.optim, cfg.loss, *workers, delay=cfg.bapo.delay, use_x2=cfg.bapo.use_x2,
                       **options)


class SleepingCheckpointManager(StandInCheckpointManager):
    """CheckpointEngineManager's colocated contract with free_cache_engine=True: sleep_replicas frees the engine's
    memory (level 2: its weights are gone), update_weights wakes it with the actor's weights (verl's naive sync)."""

    def __init__(self, actor, engine):
        super().__init__(actor, engine)
        self.asleep, self.events = False, []

    @torch.no_grad()
    def sleep_replicas(self):
        for p in self.engine.parameters():
            p.fill_(float("nan"))
        self.asleep = True
        self.events.append("sleep")

    def update_weights(self, global_steps=None):
        super().update_weights(global_steps)
        self.asleep = False
        self.events.append("wake")


def make_verl(cfg, dp_size=2, num_workers=4, mini_batch_size=None, free_cache_engine=False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.run.model)
    policy = AutoModelForCausalLM.from_pretrained(cfg.run.model, dtype=torch.float32).eval()
    engine = copy.deepcopy(policy)
    actor = StandInActor(policy, cfg, dp_size, mini_batch_size)
    sampling = cfg.sampling
    rollout = StandInRollout(engine, tok, sampling.max_prompt_length, sampling.max_response_length, num_workers,
                             sampling.temperature, cfg.run.seed)
    ckpt = (SleepingCheckpointManager if free_cache_engine else StandInCheckpointManager)(actor, engine)
    backend = verl_backend(cfg, rollout, actor, ckpt, tok, task_name="scheduled", divisor=num_workers,
                           dp_size=dp_size, mini_batch_size=mini_batch_size, free_cache_engine=free_cache_engine)
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
    emb = make_trainer(cfg, make_backend(cfg), task_e, task_e.problems)
    backend = make_verl(cfg)
    ver = make_trainer(cfg, backend, task_v, task_v.problems)
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
        rows = {}  # (group, response tokens) -> rows: the update orders rows by length within each optimizer step
        for i in range(len(batch)):
            key = (batch.non_tensor_batch["uid"][i], tuple(b["responses"][i][b["response_mask"][i].bool()].tolist()))
            rows.setdefault(key, []).append(i)
        # token-level advantages are our GRPO advantages per group, constant over each response
        adv = grpo_advantages(torch.tensor([g.rewards for g in groups]), eps=1e-6).flatten()
        for n, s in enumerate(samples):
            i = rows[(str(n // G), tuple(s.tokens))].pop()
            m = b["response_mask"][i].bool()
            assert torch.equal(b["old_log_probs"][i][m], torch.tensor(s.logprobs, dtype=torch.float32))
            assert torch.all(b["advantages"][i][~m] == 0)
            torch.testing.assert_close(b["advantages"][i, 0], adv[n])
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
    logp = _token_logprobs(fresh.actor.policy, ids, mask, (mask.cumsum(-1) - 1), len(s.tokens),
                           cfg.sampling.temperature)
    torch.testing.assert_close(logp[0], torch.tensor(s.logprobs), atol=1e-5, rtol=1e-4)


def test_sync_schedule_and_reevaluation_dance(runs):
    out, _, ver, backend = runs
    v, m = BAPO["delay"], BAPO["reeval_every"]
    for t, (calls, r) in enumerate(zip(out["calls_per_step"], out["ver"]), 1):
        kinds = [c[0] for c in calls]
        expect = ["sync"] if t % v == 0 else []
        if r.reevaluated and t % v != 0:  # at t % v == 0 the engine was just synced: it already holds pi_theta
            expect += ["reeval_sync", "reeval_restore"]
        assert kinds == expect, f"step {t}: {calls}"
        # weight pushes are tagged with the last training step the backend saw (verl's global_steps)
        assert all(step == t - 1 for _, step in calls), f"step {t}: {calls}"
        assert (t % m == 0) or not r.reevaluated
    assert backend.checkpoint_manager.steps == [step for _, step in backend.calls]
    # versions are the trainer's: the backend only knows whether the actor moved since alpha was pushed
    assert not hasattr(backend, "updates") and not hasattr(backend, "alpha_version")
    # synced at step 6, trained at 6 and 7
    assert backend.step == T and backend.alpha_stale and ver.rollout_version != ver.updates
    assert all(out["alpha_ok"])
    assert any(r.reevaluated for r in out["ver"])
    # every batch sent to the engine was padded to the divisor
    assert all(n % backend.divisor == 0 for n in backend.rollout_manager.lengths)


def test_resume_round_trip(model_dir, tmp_path):
    cfg = make_cfg(model_dir)
    task = ScheduledTask()
    a_backend = make_verl(cfg)
    a = make_trainer(cfg, a_backend, task, task.problems)
    for t in range(1, 5):
        a.step(t)
    state = copy.deepcopy(a.state_dict())
    task_copy = copy.deepcopy(task)
    a_backend.save_checkpoint(tmp_path / "ck", 4)
    alpha = weights(a_backend.rollout_manager.engine)
    cont = [uids(a.step(t)) for t in (5, 6)]

    b_backend = make_verl(cfg)
    b = make_trainer(cfg, b_backend, task_copy, task_copy.problems)
    b.load_state_dict(state)
    b_backend.load_checkpoint(tmp_path / "ck")
    assert same(b_backend.rollout_manager.engine, alpha)  # the stale alpha is back in the engine
    assert same(b_backend.actor.policy, torch.load(tmp_path / "ck" / "actor" / "model_world_size_1_rank_0.pt"))
    assert [uids(b.step(t)) for t in (5, 6)] == cont


def test_batch_trimmed_for_data_parallel(model_dir):
    cfg = make_cfg(model_dir, use_x2="false", use_x3="false")
    task = ScheduledTask()
    backend = make_verl(cfg, dp_size=8, mini_batch_size=2)  # G=4: two groups per 8 sequences
    tr = make_trainer(cfg, backend, task, task.problems)
    for t in range(1, 4):
        r = tr.step(t)
        n = len(r.x1 + r.x2 + r.x3)
        keep = trainable_groups(n, G, 2, 8)
        assert r.metrics["trimmed_groups"] == n - keep
        if keep:
            assert len(backend.actor.batches[-1]) == keep * G


def test_engine_sleeps_through_each_update_with_free_cache_engine(model_dir):
    """v = 1 with free_cache_engine=True: every actor pass runs with the engine asleep (its memory handed over, as
    verl's fit() does between generation and the update), every generation with it awake and holding pi_theta, so
    the run is the one with the engine kept resident."""
    cfg = make_cfg(model_dir, delay=1)
    runs = {}
    for free in (False, True):
        task = ScheduledTask()
        backend = make_verl(cfg, free_cache_engine=free)
        ckpt, rollout, actor = backend.checkpoint_manager, backend.rollout_manager, backend.actor
        at_update, at_generate = [], []
        generate, update = rollout.generate_sequences, actor.update_actor
        rollout.generate_sequences = lambda b: at_generate.append(getattr(ckpt, "asleep", False)) or generate(b)
        actor.update_actor = lambda b: at_update.append(getattr(ckpt, "asleep", False)) or update(b)
        tr = make_trainer(cfg, backend, task, task.problems)
        steps = [tr.step(t) for t in range(1, T + 1)]
        runs[free] = dict(uids=[uids(r) for r in steps], policy=weights(actor.policy), backend=backend, task=task,
                          at_update=at_update, at_generate=at_generate, reevaluated=any(r.reevaluated for r in steps))
    kept, freed = runs[False], runs[True]
    assert freed["reevaluated"] and len(freed["at_update"]) == T
    assert all(freed["at_update"]), "an actor pass ran beside the awake engine"
    assert not any(freed["at_generate"]), "generated on a sleeping engine"
    assert freed["uids"] == kept["uids"] and same(freed["backend"].actor.policy, kept["policy"])
    events = freed["backend"].checkpoint_manager.events
    assert events.count("sleep") == T and all(a != b for a, b in zip(events, events[1:]))
    # a generation after the last update (no sync in between) wakes the engine with pi_theta first
    backend = freed["backend"]
    assert backend.checkpoint_manager.asleep
    out = backend.generate([backend.encode(freed["task"].problems[0])], 2)
    assert len(out[0]) == 2 and same(backend.rollout_manager.engine, weights(backend.actor.policy))
    assert backend.calls[-1][0] == "wake"


def test_the_records_train_time_is_split_by_the_actors_calls(model_dir):
    """t_train's parts: verl's batch, the engine's sleep, the log-prob passes and verl's update_actor, each timed
    around its own call: could fail if a part were missing, timed another call's span, or outgrew t_train."""
    import time

    cfg = make_cfg(model_dir, delay=1)
    task = ScheduledTask()
    backend = make_verl(cfg, free_cache_engine=True)
    ckpt, actor = backend.checkpoint_manager, backend.actor
    sleep, update = ckpt.sleep_replicas, actor.update_actor
    ckpt.sleep_replicas = lambda: time.sleep(0.1) or sleep()
    actor.update_actor = lambda b: time.sleep(0.3) or update(b)
    tr = make_trainer(cfg, backend, task, task.problems)
    parts = ("t_train_batch", "t_train_engine_sleep", "t_train_logprobs", "t_train_actor")
    trained = [m for m in (tr.step(t).metrics for t in range(1, 4)) if m["optimizer_steps"] > 0]
    assert trained
    for m in trained:
        assert m["t_train_actor"] >= 0.3 and 0.1 <= m["t_train_engine_sleep"] < m["t_train_actor"]
        assert all(m[k] >= 0 for k in parts) and sum(m[k] for k in parts) <= m["t_train"]


def test_a_worker_out_of_gpu_memory_names_verls_setting(model_dir):
    """A GPU worker's out-of-memory error reaches the driver as Ray's RayTaskError; the backend says which of its
    calls ran out and which verl keys lower its need. Could fail if Ray's error were not caught as torch's (it is an
    instance of the worker's exception class), or the message named the embedded backend's settings."""
    import ray

    from bapo_vl.backends.gpu_memory import OutOfGpuMemory

    @ray.remote
    class Worker:
        def update_actor(self):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        worker = Worker.remote()
        cfg = make_cfg(model_dir, use_x2="false", use_x3="false")
        task = ScheduledTask()
        backend = make_verl(cfg)
        backend.actor.update_actor = lambda batch: ray.get(worker.update_actor.remote())
        tr = make_trainer(cfg, backend, task, task.problems)
        with pytest.raises(OutOfGpuMemory) as e:
            for t in range(1, 4):
                tr.step(t)
    finally:
        ray.shutdown()
    assert str(e.value) == ("verl's update (ppo_micro_batch_size_per_gpu=1) ran out of GPU memory: lower "
                            "verl.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, set "
                            "verl.actor_rollout_ref.model.enable_gradient_checkpointing=true, or spread the update "
                            "over more GPUs (verl.trainer.n_gpus_per_node, verl.trainer.nnodes)")
    assert "ray::" in str(e.value.__cause__)  # Ray's error, with the worker's traceback, stays in the chain


def test_length_order_sorts_within_each_cell():
    from bapo_vl.backends.verl_backend import length_order

    assert length_order([5, 1, 3, 2, 9, 4, 8, 7], 4) == [1, 3, 2, 0, 5, 7, 6, 4]
    assert length_order([2, 2, 1, 2, 3], 2) == [0, 1, 2, 3, 4]  # stable; a short last cell keeps its row


def test_update_rows_go_by_length_within_each_ranks_optimizer_step(model_dir):
    """verl hands each data-parallel rank a contiguous share of the batch and cuts it into mini-batches (optimizer
    steps), then micro-batches, in order. The rows reach update_actor sorted by length within each (rank, mini-batch)
    cell, so micro-batches hold neighbours in length, and each cell trains the sequences it holds in group order:
    could fail if rows crossed an optimizer step or a rank, or were left in group order."""
    cfg = make_cfg(model_dir, delay=1)
    task = ScheduledTask()
    backend = make_verl(cfg, dp_size=2)
    seen, update = [], backend.update
    backend.update = lambda batch: seen.append(batch) or update(batch)
    tr = make_trainer(cfg, backend, task, task.problems)
    for t in range(1, T + 1):
        tr.step(t)
    sent = backend.actor.batches
    assert len(sent) == len(seen) > 0
    reordered = 0
    for batch, data in zip(seen, sent):
        keep = len(data) // G
        cell = min(backend.mini_batch_size, keep) * G // backend.dp_size
        mask = data.batch["attention_mask"]
        got = [(data.non_tensor_batch["uid"][i], tuple(data.batch["input_ids"][i][mask[i].bool()].tolist()))
               for i in range(len(data))]
        group_order = [(str(g), tuple(p["input_ids"]) + tuple(r.tokens))
                       for g, p, r, *_ in batch.select(list(range(keep))).sequences()]
        for start in range(0, len(got), cell):
            block = got[start:start + cell]
            assert sorted(block) == sorted(group_order[start:start + cell])
            assert [len(s) for _, s in block] == sorted(len(s) for _, s in block)
        reordered += got != group_order
    assert reordered, "every batch reached the actor in group order"


def test_profiled_steps_run_their_actor_passes_under_verls_profiler(model_dir):
    """global_profiler.steps=[2, 3]: the profiler brackets the actor's passes of steps 2 and 3 (the reference's
    log-probs and update_actor), nothing else; the finish hook is asked for after the last profiled step only.
    Could fail if a step were missed, profiled twice, or the window left out update_actor."""
    cfg = make_cfg(model_dir, delay=1, kl_coef=0.01)
    task = ScheduledTask()
    backend = make_verl(cfg)
    backend.profile_steps = (2, 3)
    actor = backend.actor
    update, logprobs = actor.update_actor, actor.compute_ref_log_prob
    actor.update_actor = lambda b: actor.profiled.append(("update", len(b))) or update(b)
    actor.compute_ref_log_prob = lambda b: actor.profiled.append(("logprobs", len(b))) or logprobs(b)
    tr = make_trainer(cfg, backend, task, task.problems)
    metrics = [tr.step(t).metrics for t in range(1, 5)]
    trained = [t for t, m in zip(range(1, 5), metrics) if m["optimizer_steps"] > 0]
    assert {2, 3} <= set(trained), trained
    events = actor.profiled
    starts = [i for i, e in enumerate(events) if e[0] == "start"]
    assert [events[i] for i in starts] == [("start", 2), ("start", 3)]
    for i in starts:
        assert [e[0] for e in events[i:i + 4]] == ["start", "logprobs", "update", "stop"]
    assert [e for e in events if e[0] == "stop"] == [("stop", False), ("stop", True)]


def test_profiled_steps_follow_verls_global_profiler():
    """fit()'s rule: steps are profiled only once global_profiler names a tool; the composed config is verl's own."""
    from omegaconf import OmegaConf

    from bapo_vl.backends.verl_backend import profiled_steps

    vcfg = copy.deepcopy(_verl_base_config())
    assert profiled_steps(vcfg) == ()
    OmegaConf.update(vcfg, "global_profiler.steps", [2, 4])
    assert profiled_steps(vcfg) == ()
    OmegaConf.update(vcfg, "global_profiler.tool", "torch")
    assert profiled_steps(vcfg) == (2, 4)
    assert vcfg.actor_rollout_ref.actor.profiler.tool == "torch"  # the actor's profiler follows the global tool


def test_a_worker_reads_the_global_profilers_tool_and_save_path_from_the_composed_config(tmp_path):
    """verl's actor worker turns its part of the config into a ProfilerConfig dataclass, where an interpolation to
    the root (${oc.select:global_profiler.save_path}) falls to null unless the config is resolved first, as verl's
    TaskRunner.run does. Could fail if compose() left them unresolved: no trace would be written, without an error."""
    import ray.cloudpickle
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.profiler.config import ProfilerConfig

    from bapo_vl.backends.verl_main import load_configs

    _, vcfg = load_configs(str(ROOT / "bapo_vl" / "presets" / "verl_countdown.yaml"), [
        "verl.global_profiler.tool=torch", "verl.global_profiler.steps=[2]",
        f"verl.global_profiler.save_path={tmp_path}", "verl.actor_rollout_ref.actor.profiler.enable=True"])
    sent = ray.cloudpickle.loads(ray.cloudpickle.dumps(vcfg.actor_rollout_ref))  # as the worker group sends it
    profiler = omega_conf_to_dataclass(sent.actor.get("profiler", {}), dataclass_type=ProfilerConfig)
    assert (profiler.tool, profiler.save_path, profiler.enable) == ("torch", str(tmp_path), True)


def test_derived_settings_write_entropy_log_probs_clip_and_lr_into_verls_config():
    """What verl's actor is told to compute and optimise comes from our Config: behaviour log-probs from the rollout,
    the entropy of pi_theta (the record's entropy column, even with entropy_coef == 0), our clip range and lr."""
    from verl.utils.config import omega_conf_to_dataclass

    from bapo_vl.backends.verl_main import load_configs
    from bapo_vl.verl_launch import derived_settings

    preset = str(ROOT / "bapo_vl" / "presets" / "verl_countdown.yaml")
    cfg, vcfg = load_configs(preset, ["bapo.clip_low=0.15", "bapo.clip_high=0.3", "bapo.lr=2e-6",
                                      "bapo.weight_decay=0.05", "bapo.entropy_coef=0.0"])
    derived = derived_settings(cfg)
    a, r = vcfg.actor_rollout_ref.actor, vcfg.actor_rollout_ref.rollout
    assert derived["actor_rollout_ref.actor.calculate_entropy"][1] is True and a.calculate_entropy is True
    assert derived["actor_rollout_ref.rollout.calculate_log_probs"][1] is True and r.calculate_log_probs is True
    assert (a.clip_ratio_low, a.clip_ratio_high, a.optim.lr, a.optim.weight_decay) == (0.15, 0.3, 2e-6, 0.05)
    actor = omega_conf_to_dataclass(a)  # as verl's worker reads it
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.optim.lr, actor.optim.weight_decay) == \
        (0.15, 0.3, 2e-6, 0.05)
    # RayPPOTrainer._update_actor asks the worker for entropy when calculate_entropy or entropy_coeff != 0
    assert actor.entropy_coeff == 0.0 and (actor.calculate_entropy or actor.entropy_coeff != 0.0)
    with pytest.raises(ValueError, match="fixed by BAPO"):
        load_configs(preset, ["verl.actor_rollout_ref.actor.calculate_entropy=false"])


def test_grad_clip_reaches_the_clip_verls_engine_uses():
    from verl.utils.config import omega_conf_to_dataclass

    from bapo_vl.backends.verl_main import load_configs

    _, vcfg = load_configs(str(ROOT / "bapo_vl" / "presets" / "verl_countdown.yaml"), ["bapo.grad_clip=0.5"])
    # engine_workers.ActorRolloutRefWorker builds its optimizer from actor_config.optim (optimizer_config=...optim)
    assert omega_conf_to_dataclass(vcfg.actor_rollout_ref.actor).optim.clip_grad == 0.5


def test_ray_trainer_actor_forwards_to_verls_trainer_and_worker_group(model_dir):
    """verl_backend.RayTrainerActor (the `actor` VerlBackend gets on GPUs) hands each call to RayPPOTrainer's helper or
    the DetachActorWorker group, with arguments that bind to verl's real signatures."""
    import inspect
    from types import SimpleNamespace

    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from bapo_vl.backends.verl_backend import RayTrainerActor

    calls = []

    class WorkerGroup:  # RayWorkerGroup: the workers' registered methods by name
        def __getattr__(self, method):
            return lambda *args, **kwargs: calls.append(("wg", method, args, kwargs))

    from omegaconf import OmegaConf

    seen_mini = []

    class FakeRayPPOTrainer:
        actor_rollout_wg = WorkerGroup()
        config = OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 16}, "rollout": {"n": 2}}})

        def _update_actor(self, batch):
            calls.append(("trainer", "_update_actor", (batch,), {}))
            seen_mini.append(self.config.actor_rollout_ref.actor.ppo_mini_batch_size)
            return "actor output"

        def _compute_old_log_prob(self, batch):
            calls.append(("trainer", "_compute_old_log_prob", (batch,), {}))
            return "old log-probs", "mfu"

        def _compute_ref_log_prob(self, batch):
            calls.append(("trainer", "_compute_ref_log_prob", (batch,), {}))
            return "ref log-probs"

    actor = RayTrainerActor(FakeRayPPOTrainer())
    batch = DataProto.from_dict(tensors={"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    assert actor.update_actor(batch) == "actor output"
    # a batch smaller than one mini-batch (1 prompt x n=2) is trained as one smaller mini-batch, then reset
    assert seen_mini == [1] and actor.trainer.config.actor_rollout_ref.actor.ppo_mini_batch_size == 16
    assert actor.compute_log_prob(batch) == "old log-probs"  # the DataProto, not (DataProto, mfu)
    assert actor.compute_ref_log_prob(batch) == "ref log-probs"
    actor.save_model_to_cpu(ALPHA)
    actor.restore_model_from_cpu(ALPHA)
    actor.clear_cpu_model(ALPHA)
    actor.save_checkpoint("/ck/step_4/actor", global_step=4)
    actor.load_checkpoint("/ck/step_4/actor")
    # VerlBackend with X2 and delay > 1 accepts it as a snapshotting actor and snapshots alpha at once
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    verl_backend(make_cfg(model_dir), None, actor, None, tok, task_name="scheduled")

    bound = []
    for side, method, args, kwargs in calls:
        cls = RayPPOTrainer if side == "trainer" else DetachActorWorker
        arguments = inspect.signature(getattr(cls, method)).bind(None, *args, **kwargs).arguments
        bound.append((method, {k: v for k, v in arguments.items() if k != "self"}))
    assert bound == [
        ("_update_actor", {"batch": batch}),
        ("_compute_old_log_prob", {"batch": batch}),
        ("_compute_ref_log_prob", {"batch": batch}),
        ("save_model_to_cpu", {"n": ALPHA}),
        ("restore_model_from_cpu", {"n": ALPHA}),
        ("clear_cpu_model", {"n": ALPHA}),
        ("save_checkpoint", {"local_path": "/ck/step_4/actor", "hdfs_path": None, "global_step": 4,
                             "max_ckpt_to_keep": None}),
        ("load_checkpoint", {"local_path": "/ck/step_4/actor", "hdfs_path": None, "del_local_after_load": False}),
        ("save_model_to_cpu", {"n": ALPHA}),
    ]
    assert all(args[0] is batch for side, _, args, _ in calls if side == "trainer")


# --- the record's metric names from verl's -------------------------------------------------------------------------

# The record's column <- the name verl's actor path reports it under (written out here, not read from VERL_METRICS)
RECORD_FROM_VERL = {"loss": "actor/loss", "pg_loss": "actor/pg_loss", "kl": "actor/kl_loss",
                    "entropy": "actor/entropy_loss", "clip_frac": "actor/pg_clipfrac", "grad_norm": "actor/grad_norm",
                    "lr": "actor/lr"}


def test_stand_in_actor_metrics_have_verls_names(runs):
    """What the stand-in's update_actor returns has the keys verl's actor path returns (see StandInActor); the keys
    it writes itself are those verl's own code writes (ppo_loss, the engine worker's _postprocess_output)."""
    import inspect

    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    assert set(RECORD_FROM_VERL) == set(UPDATE_METRICS) - set(COUNTED) == set(VERL_METRICS)
    assert all(RECORD_FROM_VERL[k] in VERL_METRICS[k] for k in VERL_METRICS)
    source = inspect.getsource(ppo_loss)
    for key in ("actor/pg_loss", "actor/entropy_loss", "kl_loss", "kl_coef"):
        assert f'metrics["{key}"]' in source, key
    source = inspect.getsource(TrainingWorker._postprocess_output)
    for key in ("loss", "grad_norm", "lr", "mfu", "perf/max_memory_reserved_gb"):
        assert f'final_metrics["{key}"]' in source, key
    _, _, _, backend = runs
    assert len(backend.actor.metrics) == T
    for m in backend.actor.metrics:
        assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/entropy_loss",
                "actor/loss", "actor/grad_norm", "actor/lr", "perf/mfu/actor"} <= set(m)
        assert not any(k.startswith("actor/actor/") for k in m) and "actor/kl_loss" not in m  # kl_coef == 0
        assert len(m["actor/loss"]) == len(m["actor/grad_norm"]) >= 1 and len(m["actor/lr"]) == 1


def test_update_metrics_reach_the_run_record(model_dir, tmp_path, monkeypatch):
    """bapo_vl.train.train over VerlBackend: every step that trained a group has the record's update metrics
    (base.UPDATE_METRICS) as finite numbers, each the value verl's actor reported under its own name."""
    from bapo_vl import train as train_module
    from bapo_vl.reader import read_run

    cfg = make_cfg(model_dir, steps=3, run_dir=tmp_path, name="verl-run")
    task = ScheduledTask()
    monkeypatch.setattr(train_module, "get_task", lambda *args, **kwargs: task)
    backend = make_verl(cfg)
    run_dir = train_module.train(cfg, quiet=True, backend=backend)
    run = read_run(run_dir)
    assert run["meta"]["backend"] == "verl"
    steps = run["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    trained = [s for s in steps if s["trained_groups"] > s.get("trimmed_groups", 0)]
    assert trained and len(trained) == len(backend.actor.metrics)
    for s, verl_metrics in zip(trained, backend.actor.metrics):
        for key in UPDATE_METRICS:
            kind_of = int if key in ("optimizer_steps", "trained_tokens") else float
            assert isinstance(s.get(key), kind_of) and math.isfinite(s[key]), (s["step"], key, s.get(key))
        for key, name in RECORD_FROM_VERL.items():  # the record's column is verl's number
            if key == "kl":  # kl_coef == 0: no reference policy, no KL term, kl is 0.0 (as on the embedded backend)
                assert name not in verl_metrics and name not in s and s[key] == 0.0
                continue
            expect = float(np.mean(verl_metrics[name]))
            assert s[key] == pytest.approx(expect, rel=1e-12) and s[name] == s[key], (s["step"], key)
        assert s["entropy"] > 0 and s["grad_norm"] > 0  # computed from the model, not placeholders
        assert s["actor/lr"] == cfg.optim.lr
        # the embedded backend's column for the KL to the rollout policy, from verl's number
        assert s["ppo_kl"] == pytest.approx(float(np.mean(verl_metrics["actor/ppo_kl"])), rel=1e-12)
        # the most the actor's torch reserved, which verl gives in GiB, in the record's GB
        assert s["gpu_memory_train_gb"] == pytest.approx(2.5 * 2**30 / 1e9, rel=1e-12)
        trained = s["trained_groups"] - s["trimmed_groups"]
        assert s["optimizer_steps"] == cfg.optim.epochs * max(1, trained // cfg.optim.mini_batch_size)


def test_kl_term_reaches_the_record_columns(model_dir):
    """With kl_coef > 0 the update batch carries the reference log-probs and the record's kl is verl's kl_loss."""
    cfg = make_cfg(model_dir, kl_coef=0.05, use_x2="false")
    task = ScheduledTask()
    backend = make_verl(cfg)
    ref = weights(backend.actor.ref)
    tr = make_trainer(cfg, backend, task, task.problems)
    results = [tr.step(t) for t in range(1, 4)]
    assert len(backend.actor.batches) == 3 and all("ref_log_prob" in b.batch.keys() for b in backend.actor.batches)
    for r in results:
        m = r.metrics
        assert m["actor/kl_coef"] == 0.05 and m["kl"] == m[RECORD_FROM_VERL["kl"]]
        assert all(math.isfinite(m[k]) for k in UPDATE_METRICS)
    # the first update starts at the reference weights; later ones have moved away from it
    assert abs(results[0].metrics["kl"]) < 1e-6 and all(r.metrics["kl"] > 0 for r in results[1:])
    assert same(backend.actor.ref, ref)


@pytest.mark.parametrize("task", ["math", "countdown", "geometry3k"])
def test_presets_compose_with_verls_real_config(task):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import ActorConfig

    from bapo_vl.backends.verl_main import load_configs
    from bapo_vl.verl_launch import derived_settings

    cfg, vcfg = load_configs(str(ROOT / "bapo_vl" / "presets" / f"verl_{task}.yaml"),
                             ["bapo.delay=3", "bapo.loss=balanced_clip", "bapo.lr=3e-6", "verl.trainer.nnodes=2"])
    paper = load_config(task)  # the verl preset starts from our paper preset
    assert (cfg.run.task, cfg.run.model, cfg.sampling.batch_size, cfg.sampling.max_response_length) == \
        (task, paper.run.model, paper.sampling.batch_size, paper.sampling.max_response_length)
    assert cfg.bapo.delay == 3 and cfg.optim.lr == 3e-6 and vcfg.trainer.nnodes == 2
    r, a = vcfg.actor_rollout_ref.rollout, vcfg.actor_rollout_ref.actor
    assert r.free_cache_engine is False and r.calculate_log_probs is True and r.n == cfg.sampling.group_size
    assert vcfg.actor_rollout_ref.model.path == cfg.run.model and r.response_length == cfg.sampling.max_response_length
    assert a.optim.lr == 3e-6 and a.policy_loss.loss_mode == "bapo_balanced_clip"
    loss = cfg.loss
    assert a.kl_loss_coef == loss.kl_coef and a.use_kl_loss is (loss.kl_coef > 0)
    assert a.entropy_coeff == loss.entropy_coef
    for key, (_, value) in derived_settings(cfg).items():
        node = vcfg
        for part in key.split("."):
            node = node[part]
        assert node == value, key
    validate_verl_config(r.name, r.free_cache_engine, cfg.bapo.delay)
    assert vcfg.reward.custom_reward_function.name == "compute_score" and vcfg.trainer.use_v1 is False
    actor = omega_conf_to_dataclass(a)  # as verl's actor worker builds it; its own checks accept it
    actor.validate(n_gpus=8, train_batch_size=cfg.sampling.batch_size)
    assert isinstance(actor, ActorConfig) and actor.clip_ratio_low == loss.clip_low and actor.loss_agg_mode == loss.agg


@pytest.mark.parametrize("task", ["tiny", "countdown", "math", "geometry3k"])
def test_bapo_train_backend_verl_composes_what_verl_main_composes(task):
    """`bapo train --preset verl_<task> KEY=V verl.K=V` and `bapo train backend=verl --config verl_<task>.yaml ...`
    load the Config that `python -m bapo_vl.backends.verl_main --config verl_<task>.yaml bapo.KEY=V verl.K=V` loads,
    and compose the same verl config: verl's own Hydra composition of the preset's verl: keys with the command
    line's (as verl_main passed them before the launcher moved: the text of each value), every derived setting in."""
    import yaml
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import verl
    from bapo_vl.backends.verl_main import load_configs
    from bapo_vl.verl_launch import compose as compose_verl, derived_settings

    path = ROOT / "bapo_vl" / "presets" / f"verl_{task}.yaml"
    front = load_config(f"verl_{task}", overrides=["delay=3", "lr=3e-6", "verl.trainer.nnodes=2"])
    by_file = load_config(file=str(path), overrides=["backend=verl", "delay=3", "lr=3e-6", "verl.trainer.nnodes=2"])
    old_cfg, old_vcfg = load_configs(str(path), ["bapo.delay=3", "bapo.lr=3e-6", "verl.trainer.nnodes=2"])
    assert front == by_file == old_cfg and (front.run.backend, front.bapo.delay, front.optim.lr) == ("verl", 3, 3e-6)
    keys = {**{k: str(v) for k, v in yaml.safe_load(path.read_text())["verl"].items()}, "trainer.nnodes": "2"}
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        expected = compose(config_name="ppo_trainer", overrides=[f"{k}={v}" for k, v in keys.items()])
    OmegaConf.set_struct(expected, False)
    for key, (_, value) in derived_settings(front).items():
        OmegaConf.update(expected, key, value, merge=False)
    got = OmegaConf.to_container(compose_verl(front))
    assert got == OmegaConf.to_container(old_vcfg) == OmegaConf.to_container(expected, resolve=True)
    assert got["trainer"]["nnodes"] == 2 and got["actor_rollout_ref"]["actor"]["optim"]["lr"] == 3e-6


def test_bapo_train_backend_verl_reaches_the_verl_launcher(capsys, monkeypatch):
    """`bapo train` hands a verl config to bapo_vl.verl_launch.launch: verl's config is composed (a verl key our
    config decides is refused there, one line), and a whole config goes on to where verl's workers need GPUs."""
    from bapo_vl.cli import main

    assert main(["train", "--preset", "verl_math", "verl.actor_rollout_ref.actor.optim.lr=1e-5"]) == 2
    assert capsys.readouterr().err == ("bapo: verl.actor_rollout_ref.actor.optim.lr is set from our config: use lr= "
                                       "instead\n")
    assert main(["train", "backend=verl", "verl.critic.enable=true"]) == 2
    assert "bapo: verl.critic.enable is set from our config: use critic= instead (BA-PPO is embedded-only)" in \
        capsys.readouterr().err
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the launcher would start the run")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["train", "--preset", "verl_tiny", "steps=1"]) == 2
    assert capsys.readouterr().err.startswith("bapo: backend=verl: verl's workers run on CUDA GPUs and torch sees none")


def test_verl_overrides_of_our_settings_are_refused():
    from bapo_vl.backends.verl_main import load_configs

    preset = str(ROOT / "bapo_vl" / "presets" / "verl_math.yaml")
    with pytest.raises(ValueError, match=r"use lr= instead"):
        load_configs(preset, ["verl.actor_rollout_ref.actor.optim.lr=1e-5"])
    with pytest.raises(ValueError, match="fixed by BAPO"):
        load_configs(preset, ["verl.actor_rollout_ref.rollout.calculate_log_probs=false"])


@pytest.mark.parametrize("field", ["rollout_engine=vllm", "micro_batch_size=4", "dtype=float32"])
def test_embedded_only_settings_are_refused_on_verl_with_what_to_use(field):
    # Could fail if verl silently ignored a setting the user gave (it used to).
    from bapo_vl.backends.verl_main import load_configs

    preset = str(ROOT / "bapo_vl" / "presets" / "verl_math.yaml")
    with pytest.raises(ValueError, match=rf"^{field.partition('=')[0]}=.*: the verl backend does not use it; .*verl"):
        load_configs(preset, [f"bapo.{field}"])


def test_verl_discovers_our_loss_plugin_on_import():
    """A fresh interpreter (as a Ray worker is): `import verl` alone registers bapo_balanced_clip."""
    import subprocess
    import sys

    code = ("import verl\nfrom verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
            "print(get_policy_loss_fn('bapo_balanced_clip').__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "bapo_vl.backends.verl_loss"


def test_verl_log_probs_without_flash_attn_go_by_chunks_with_verls_numbers():
    """bapo-vl's verl worker puts our chunked log-probs where verl's per-row loop was as it starts (before verl's own
    set-up, which may fail here without a GPU), while `import verl` alone (any verl job: our plugin is imported
    everywhere) keeps verl's. Same numbers and gradients, fp32 and bf16, 2-D (verl's FSDP engine: one row per token)
    and 3-D. Could fail if the worker did not reach verl's dispatcher, importing the plugin did, or a value changed."""
    import subprocess
    import sys

    import verl.utils.torch_functional as tf

    from bapo_vl.backends import verl_loss

    show = "import verl.utils.torch_functional as t; print(t.logprobs_from_logits_v2.__module__)"
    plain = "import verl, bapo_vl.backends.verl_loss\n" + show
    worker = ("from bapo_vl.backends.verl_workers import ActorWorker\n"
              "try:\n    ActorWorker.__init__(object.__new__(ActorWorker), config=None, role='actor')\n"
              "except Exception:\n    pass\n" + show)
    for code, module in ((plain, "verl.utils.torch_functional"), (worker, "bapo_vl.backends.verl_loss")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == module, out.stderr[-2000:]
    if tf.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE:
        pytest.skip("flash-attn's kernel is verl's path here")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((verl_loss.LOGPROB_ROWS + 37, 263), (3, 50, 263)):
            logits = torch.randn(*shape, generator=gen).to(dtype).requires_grad_()
            labels = torch.randint(0, 263, shape[:-1], generator=gen)
            ours = verl_loss.logprobs_by_chunks(logits, labels)
            theirs = verl_loss.verl_row_loop(logits, labels)
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
            g_ours, = torch.autograd.grad(ours.float().sum(), logits)
            g_theirs, = torch.autograd.grad(theirs.float().sum(), logits)
            assert torch.equal(g_ours, g_theirs)


@pytest.mark.parametrize("loss,extra", [("ppo_clip", []), ("ppo_clip", ["bapo.dual_clip=3.0"]),
                                        ("ppo_clip", ["bapo.clip_high=0.28", "bapo.loss_agg=seq-mean-token-mean"]),
                                        ("gspo", ["bapo.loss_agg=seq-mean-token-mean"]),
                                        ("balanced_clip", ["bapo.bac_target=0.6", "bapo.bac_clip_low_range=[0.5,0.9]"])])
def test_verl_actor_computes_our_loss(loss, extra):
    """The policy loss verl's actor computes from the derived config equals ours on the same tensors."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    from bapo_vl.backends import verl_loss
    from bapo_vl.backends.verl_main import load_configs
    from bapo_vl.losses import aggregate, get_policy_loss

    cfg, vcfg = load_configs(str(ROOT / "bapo_vl" / "presets" / "verl_math.yaml"), [f"bapo.loss={loss}", *extra])
    actor = omega_conf_to_dataclass(vcfg.actor_rollout_ref.actor)  # as verl's worker builds it
    if loss == "balanced_clip":  # its settings travel in verl's config, to the loss function
        assert isinstance(actor.policy_loss, verl_loss.BalancedClipLossConfig)
        assert actor.policy_loss.bac_target == 0.6 and tuple(actor.policy_loss.bac_clip_low_range) == (0.5, 0.9)
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=gen, dtype=torch.float64) * 3
    logp = old + torch.randn(6, 9, generator=gen, dtype=torch.float64) * 0.6
    adv = torch.randn(6, 1, generator=gen, dtype=torch.float64).expand(6, 9)
    mask = (torch.arange(9)[None] < torch.tensor([[9], [7], [3], [9], [1], [5]])).double()
    ours_mat, _ = get_policy_loss(cfg.loss.name)(logp, old, adv, mask, cfg.loss)
    ours = aggregate(ours_mat, mask, cfg.loss.agg)
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
    backend = verl_backend(cfg, None, None, None, tok, proc, task_name="geometry3k")
    problems = [p for p in _problems("geometry3k", 40)]
    first = problems[0]
    other = next(p for p in problems if p.images[0].size != first.images[0].size)
    enc = [backend.encode(p) for p in (first, other)]
    assert len(enc[0]["input_ids"]) != len(enc[1]["input_ids"])
    responses = [[tok.convert_tokens_to_ids(c) for c in "<answer>B"], [tok.convert_tokens_to_ids(c) for c in "A"]]
    update = UpdateBatch(prompts=tuple(enc),
                         responses=tuple((Response(tuple(r), (-0.5,) * len(r)),) for r in responses),
                         rewards=((1.0,), (0.0,)), advantages=((1.0,), (-1.0,)), step=7)
    batch = backend.batch_to_dataproto(update)
    assert batch.meta_info["global_steps"] == 7
    assert batch.batch["advantages"][:, 0].tolist() == [1.0, -1.0]
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
    def response_logits(model, batch: DataProto):
        b, mm = batch.batch, batch.non_tensor_batch["multi_modal_inputs"]
        R = b["responses"].shape[1]
        rows = []
        for i in range(len(batch)):
            logits = model(input_ids=b["input_ids"][i:i + 1], attention_mask=b["attention_mask"][i:i + 1],
                           position_ids=b["position_ids"][i:i + 1].transpose(0, 1),
                           pixel_values=mm[i]["pixel_values"], image_grid_thw=mm[i]["image_grid_thw"]).logits
            rows.append(logits[:, -R - 1:-1].float() / batch.meta_info["temperature"])
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
    rollout = VLStandInRollout(engine, proc, cfg.sampling.max_response_length, cfg.sampling.temperature, cfg.run.seed)
    backend = verl_backend(cfg, rollout, actor, StandInCheckpointManager(actor, engine), tok, proc,
                           task_name="geometry3k")
    tr = make_trainer(cfg, backend, task, task.problems)
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


def test_resume_takes_the_runs_recorded_config_not_the_presets(tmp_path):
    """`verl_main --config P bapo.resume=DIR`: model, task and batch come from DIR's record (on a GPU, the preset's
    hub id was loaded instead of the run's local model and the resume died offline); allowed changes still apply,
    and P's verl: keys say how verl runs it, as they did before verl: keys were recorded with the run."""
    import json
    import sqlite3

    from bapo_vl.backends.verl_main import load_configs
    from bapo_vl.config import load_config, resume_config
    from bapo_vl.train import train

    run = train(load_config(overrides=["steps=1", "batch_size=4", "max_response_length=8", f"run_dir={tmp_path}",
                                       "name=r", "lr=3e-4"]), quiet=True)
    # the record as a verl run wrote it before Config had `backend` and `verl` (no GPU here to write a verl run)
    with sqlite3.connect(run / "run.db") as conn:
        config = {k: v for k, v in json.loads(conn.execute("SELECT json FROM config").fetchone()[0]).items()
                  if k not in ("backend", "verl")}
        conn.execute("UPDATE config SET json = ?", (json.dumps(config),))
        conn.execute("UPDATE meta SET value = 'verl' WHERE key = 'backend'")
    conn.close()
    preset = ROOT / "bapo_vl" / "presets" / "verl_geometry3k.yaml"  # a different task and hub model
    cfg, vcfg = load_configs(str(preset), [f"bapo.resume={run}", "bapo.steps=3", "verl.trainer.nnodes=2"])
    assert (cfg.run.task, cfg.sampling.batch_size, cfg.optim.lr, cfg.run.steps, cfg.run.resume) == \
        ("countdown", 4, 3e-4, 3, str(run))
    assert cfg.run.backend == "verl"
    assert cfg.verl.overrides == {**load_config("verl_geometry3k").verl.overrides, "trainer.nnodes": "2"}
    assert vcfg.actor_rollout_ref.model.path == load_configs(str(ROOT / "bapo_vl" / "presets" / "verl_tiny.yaml"),
                                                             [])[1].actor_rollout_ref.model.path
    assert vcfg.trainer.nnodes == 2 and vcfg.data.image_key == "images"  # the command line's, then the preset's
    # `bapo train resume=DIR`: the recorded config alone (this older record has no verl: keys)
    resumed = resume_config(run, ["steps=3", "verl.trainer.nnodes=2"])
    assert (resumed.run.backend, resumed.verl.overrides, resumed.run.task) == \
        ("verl", {"trainer.nnodes": "2"}, "countdown")


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_the_actor_workers_vision_tower_attends_by_segments_under_fsdp(strategy, tmp_path):
    """verl's actor is a transformers model sharded by FSDP2 (strategy=fsdp2, the presets') or FSDP1 (fsdp, verl's
    default: flat parameters); without flash-attn its vision tower would loop over images and windows.
    ActorWorker.init_model, dispatched as verl dispatches its own (ONE_TO_ALL), selects segment attention on the
    built model: on a real sharded tiny Qwen2.5-VL (gloo, one rank, CPU) the tower takes it, the language model keeps
    sdpa, and the logits and gradients are those of the unsharded sdpa model (FSDP1's flat parameters: the gradient
    that reaches the images, through every vision block).
    Could fail if the sharded model refused the selection or the results moved."""
    import torch.distributed as dist
    from PIL import Image
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from bapo_vl.backends.verl_workers import ActorWorker
    from bapo_vl.tiny import build_qwen2_5_vl
    from bapo_vl.vision_attention import NAME, use_segment_attention

    assert getattr(ActorWorker.init_model, MAGIC_ATTR) == getattr(ActorRolloutRefWorker.init_model, MAGIC_ATTR)
    model, processor = build_qwen2_5_vl(seed=0, vision=dict(depth=4, fullatt_block_indexes=[1]),
                                        max_pixels=400 * 400)
    torch.manual_seed(1)
    for p in model.parameters():  # away from the init, so every block's attention matters
        p.data.normal_(0, 0.05)
    images = [Image.new("RGB", s, c) for s, c in zip([(300, 180), (200, 250)], ["white", "gray"])]
    for im in images:
        im.paste((200, 30, 30), (10, 10, 120, 90))
    inputs = processor(text=["<|vision_start|><|image_pad|><|vision_end|>hi"] * 2, images=images,
                       return_tensors="pt", padding=True)

    def logits_and_grads(m):
        m.zero_grad()
        pixels = inputs["pixel_values"].clone().requires_grad_(True)
        logits = m(**(inputs | {"pixel_values": pixels})).logits
        logits.float().pow(2).mean().backward()
        grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for n, p in m.named_parameters() if p.grad is not None}
        return logits.detach(), grads if strategy == "fsdp2" or m is model else {}, pixels.grad

    reference = logits_and_grads(model.train())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        if strategy == "fsdp2":
            for block in model.model.visual.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            sharded = model
        else:  # as verl's engine wraps it with strategy=fsdp (use_orig_params false: flat parameters)
            blocks = ModuleWrapPolicy({type(model.model.visual.blocks[0])})
            sharded = FullyShardedDataParallel(model, auto_wrap_policy=blocks, device_id=torch.device("cpu"),
                                               use_orig_params=False)
        assert use_segment_attention(sharded)
        assert (model.config.vision_config._attn_implementation, model.config.text_config._attn_implementation) \
            == (NAME, "sdpa")
        logits, grads, pixel_grad = logits_and_grads(sharded)
    finally:
        dist.destroy_process_group()
    assert torch.allclose(logits, reference[0], atol=1e-5, rtol=1e-4)
    assert torch.allclose(pixel_grad, reference[2], atol=1e-7, rtol=1e-4)
    if strategy == "fsdp2":
        assert grads.keys() == reference[1].keys()
        for name, g in grads.items():
            assert torch.allclose(g, reference[1][name], atol=1e-6, rtol=1e-4), name


def test_verls_fused_log_probs_on_qwen2_5_vl_match_full_precision(tmp_path, monkeypatch):
    """The Geometry3K preset trains with verl's fused log-probs (`use_fused_kernels`, torch backend: the LM head and
    log-softmax by chunks of tokens, never the whole (tokens x vocabulary) logits). On an update batch of two diagrams
    from our backend, right-padded as verl's engine pads a micro-batch, its per-token log-probs and entropy at a
    temperature and the gradients of a PPO-shaped loss through them equal the unpatched model's in float64.
    Could fail if verl's patched forward dropped the images or positions, or mis-aligned labels with padding."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as q25
    from transformers.models.qwen2_vl import modeling_qwen2_vl as q2
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import hf_processor

    from bapo_vl.tiny import build_qwen2_5_vl

    model, processor = build_qwen2_5_vl(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64)
    torch.manual_seed(1)
    for p in model.parameters():  # away from the init, so that log-probs and entropy vary by token
        p.data.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    tok = AutoTokenizer.from_pretrained(tmp_path / "vl")
    cfg = make_cfg(tmp_path / "vl", task="geometry3k", max_prompt_length=4096, use_x2="false")
    backend = verl_backend(cfg, None, None, None, tok, hf_processor(str(tmp_path / "vl")), task_name="geometry3k")
    problems = _problems("geometry3k", 40)
    pair = [problems[0], next(p for p in problems if p.images[0].size != problems[0].images[0].size)]
    responses = [[tok.convert_tokens_to_ids(c) for c in "<answer>B"], [tok.convert_tokens_to_ids(c) for c in "A12"]]
    update = UpdateBatch(prompts=tuple(backend.encode(p) for p in pair),
                         responses=tuple((Response(tuple(r), (-0.5,) * len(r)),) for r in responses),
                         rewards=((1.0,), (0.0,)), advantages=((1.0,), (-1.0,)), step=1)
    data = backend.batch_to_dataproto(update)
    mm = data.non_tensor_batch["multi_modal_inputs"]
    keep = data.batch["attention_mask"].bool()
    rows = [(data.batch["input_ids"][i][keep[i]], data.batch["position_ids"][i][:, keep[i]]) for i in range(2)]
    R = data.batch["responses"].shape[1]
    spans = [(len(ids) - int(data.batch["response_mask"][i].sum()) - 1, len(ids) - 1)  # positions scoring the responses
             for i, (ids, _) in enumerate(rows)]
    T, weights = 0.7, torch.tensor([1.0, -1.0])
    assert R and all(b - a == len(r) for (a, b), r in zip(spans, responses))

    def loss_of(log_probs, entropy):  # per row: advantage x log-probs of its response, plus an entropy bonus
        return sum(w * lp[a:b].sum() + 0.01 * h[a:b].sum()
                   for w, lp, h, (a, b) in zip(weights, log_probs, entropy, spans))

    reference = copy.deepcopy(model).double()
    log_probs, entropy = [], []
    for i, (ids, pos) in enumerate(rows):  # one unpadded row at a time, the model's own forward
        logits = reference(input_ids=ids[None], position_ids=pos[:, None], pixel_values=mm[i]["pixel_values"].double(),
                           image_grid_thw=mm[i]["image_grid_thw"]).logits[0] / T
        logp = logits.log_softmax(-1)
        log_probs.append(logp[:-1].gather(-1, ids[1:, None])[:, 0])
        entropy.append(-(logp.exp() * logp).sum(-1)[:-1])
    loss_of(log_probs, entropy).backward()
    ref_lp, ref_h = [x.detach() for x in log_probs], [x.detach() for x in entropy]

    for cls in (q25.Qwen2_5_VLModel, q25.Qwen2_5_VLForConditionalGeneration, q2.Qwen2VLModel,
                q2.Qwen2VLForConditionalGeneration):
        monkeypatch.setattr(cls, "forward", cls.forward)  # verl patches the classes; undone after the test
    apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend="torch")
    L = max(len(ids) for ids, _ in rows)  # right-padded, as verl's engine pads a micro-batch without remove-padding
    input_ids = torch.stack([torch.nn.functional.pad(ids, (0, L - len(ids)), value=backend.pad_id) for ids, _ in rows])
    position_ids = torch.stack([torch.nn.functional.pad(pos, (0, L - pos.shape[1])) for _, pos in rows], dim=1)
    mask = (torch.arange(L)[None] < torch.tensor([len(ids) for ids, _ in rows])[:, None]).long()
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                pixel_values=torch.cat([m["pixel_values"] for m in mm]),
                image_grid_thw=torch.cat([m["image_grid_thw"] for m in mm]), temperature=T, return_dict=True)
    assert not hasattr(out, "logits") or out.logits is None  # no (tokens x vocabulary) tensor
    loss_of(out.log_probs, out.entropy).backward()
    for i, (a, b) in enumerate(spans):
        torch.testing.assert_close(out.log_probs[i, a:b].double(), ref_lp[i][a:b], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.entropy[i, a:b].double(), ref_h[i][a:b], rtol=1e-5, atol=1e-5)
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
