"""Entry point: `python -m bapo_vl.backends.verl_main --config bapo_vl/presets/verl_math.yaml [key=value ...]`.

Pattern: verl-recipe's DAPO (`RayDAPOTrainer(RayPPOTrainer)` with its own step loop, started by
`run_ppo(config, task_runner_class=...)`). We take the legacy `RayPPOTrainer` (trainer.use_v1=false) because its
`init_workers()` builds exactly the three objects BAPO needs (actor worker group, AgentLoopManager, checkpoint engine
manager) and keeps batches in the driver: BAPO's buffers hold groups across steps, which the V1 TransferQueue
trainer clears every step. The step loop is NOT verl's `fit()`: it is bapo_vl.trainer.Trainer over VerlBackend,
writing the same run record as the embedded backend.

The YAML has three parts: `preset:` (one of our presets, e.g. math), `bapo:` (changes to our Config fields) and
`verl:` (overrides of verl's ppo_trainer config, dotted keys, for how verl runs: parallelism, memory, engine).
Everything our Config decides is written into verl's config by `derived_settings`, and refused under `verl:`.
Overrides on the command line: `bapo.delay=3` or `verl.trainer.nnodes=2`.

On CPU (no vLLM), tests check the config it composes and that RayTrainerActor forwards to verl's real method
signatures; build_verl_workers and main run on the GPU machines (docs/results.md, scripts/gpu/verl_checks.py).
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import yaml

log = logging.getLogger(__name__)


# Config fields only the embedded backend reads -> what sets the same thing on verl. Setting one for a verl run is
# refused rather than silently ignored.
EMBEDDED_ONLY = {
    "rollout_engine": "verl samples with its own engine: verl.actor_rollout_ref.rollout.name",
    "vllm_options": "set verl's vLLM through verl.actor_rollout_ref.rollout.* (e.g. gpu_memory_utilization)",
    "generate_batch_size": "verl's engine batches the rollouts itself (verl.actor_rollout_ref.rollout.max_num_seqs)",
    "score_batch_size": "use verl.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "micro_batch_size": "use verl.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "dtype": "verl computes in bf16 under FSDP's mixed precision (verl.actor_rollout_ref.actor.fsdp_config)",
}


def load_configs(path: str, overrides: list[str]):
    """(our Config, verl OmegaConf) from a verl_*.yaml preset plus `bapo.k=v` / `verl.a.b=v` overrides."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import verl
    from bapo_vl.config import load_config

    data = yaml.safe_load(Path(path).read_text())
    bapo = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
            for k, v in (data.get("bapo") or {}).items()]
    given = []  # bapo. overrides from the command line
    verl_keys = {k: str(v) for k, v in (data.get("verl") or {}).items()}
    for item in overrides:
        scope, _, rest = item.partition(".")
        if scope == "bapo":
            given.append(rest)
        elif scope == "verl":
            key, _, value = rest.partition("=")
            verl_keys[key] = value  # the command line wins over the preset file (hydra refuses a key twice)
        else:
            raise ValueError(f"override {item!r}: prefix it with bapo. or verl.")
    verl_over = [f"{k}={v}" for k, v in verl_keys.items()]
    resume = next((o.partition("=")[2] for o in given if o.startswith("resume=")), None)
    if resume:  # the run's recorded config, not the preset's (as `bapo train resume=DIR`)
        from bapo_vl.train import resume_config
        cfg = resume_config(resume, [o for o in given if not o.startswith("resume=")])
    else:
        cfg = load_config(preset=data.get("preset"), overrides=bapo + given)
    for key in dict.fromkeys(o.partition("=")[0] for o in bapo + given):
        if key in EMBEDDED_ONLY:
            raise ValueError(f"bapo.{key}: the verl backend does not use it; {EMBEDDED_ONLY[key]}")
    derived = derived_settings(cfg)
    for item in verl_over:
        key = item.partition("=")[0].lstrip("+")
        if key in derived:
            source = derived[key][0]
            raise ValueError(f"verl.{key} is fixed by BAPO {source}" if source.startswith("(") else
                             f"verl.{key} is set from our config: use bapo.{source} instead")
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        vcfg = compose(config_name="ppo_trainer", overrides=verl_over)
    OmegaConf.set_struct(vcfg, False)
    for key, (_, value) in derived.items():
        OmegaConf.update(vcfg, key, value, merge=False)
    return cfg, vcfg


def derived_settings(cfg) -> dict[str, tuple[str, object]]:
    """verl keys decided by our Config: {dotted verl key: (our field, value)}. One place per setting: a `verl.`
    override of any of these is refused."""
    from bapo_vl.models import resolve_model
    from bapo_vl.backends.verl_loss import actor_settings

    out = {f"actor_rollout_ref.actor.{k}": v for k, v in actor_settings(cfg).items()}
    rollout = "actor_rollout_ref.rollout."
    out.update({
        "trainer.use_v1": ("(BAPO needs the legacy trainer)", False),
        "algorithm.adv_estimator": ("(the Trainer computes GRPO advantages)", "grpo"),
        "critic.enable": ("critic (BA-PPO is embedded-only)", False),
        "actor_rollout_ref.model.path": ("model", resolve_model(cfg.model)),  # bundled names as the embedded one
        rollout + "calculate_log_probs": ("(BAPO needs behaviour log-probs)", True),
        "actor_rollout_ref.actor.calculate_entropy": ("(the run record's entropy column)", True),
        rollout + "n": ("group_size", cfg.group_size),
        rollout + "temperature": ("temperature", cfg.temperature),
        rollout + "top_p": ("top_p", cfg.top_p),
        rollout + "top_k": ("top_k", cfg.top_k),
        rollout + "prompt_length": ("max_prompt_length", cfg.max_prompt_length),
        rollout + "response_length": ("max_response_length", cfg.max_response_length),
        "data.max_prompt_length": ("max_prompt_length", cfg.max_prompt_length),
        "data.max_response_length": ("max_response_length", cfg.max_response_length),
        "data.train_batch_size": ("batch_size", cfg.batch_size),
        "trainer.total_training_steps": ("steps", cfg.steps),
        "reward.custom_reward_function.path": ("(our verifiers)", str(Path(__file__).with_name("verl_data.py"))),
        "reward.custom_reward_function.name": ("(our verifiers)", "compute_score"),
    })
    return out


def build_verl_workers(vcfg):
    """The real workers, from inside the Ray task runner: returns (RayPPOTrainer, kwargs for VerlBackend).
    The actor-rollout worker is bapo_vl.backends.verl_workers.ActorWorker (verl's DetachActorWorker)."""
    from verl.trainer.main_ppo_v0 import TaskRunner
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.utils import Role
    from verl.utils.config import omega_conf_to_dataclass

    from bapo_vl.backends.verl_workers import ActorWorker

    runner = TaskRunner.__ray_actor_class__()  # its helpers, run in this process
    _, group_cls = runner.add_actor_rollout_worker(vcfg)
    import ray
    for role in list(runner.role_worker_mapping):
        if role in (Role.ActorRollout, Role.ActorRolloutRef):
            runner.role_worker_mapping[role] = ray.remote(ActorWorker)
    runner.add_ref_policy_worker(vcfg, runner.role_worker_mapping.get(Role.ActorRollout))
    model_config = omega_conf_to_dataclass(vcfg.actor_rollout_ref.model)
    # verl's own dataloaders are never iterated (our PromptSampler feeds the Trainer): placeholders of the right
    # length stand in for data.train_files / val_files
    placeholder = [{}] * vcfg.data.train_batch_size
    trainer = RayPPOTrainer(config=vcfg, tokenizer=model_config.tokenizer, processor=model_config.processor,
                            role_worker_mapping=runner.role_worker_mapping,
                            resource_pool_manager=runner.init_resource_pool_mgr(vcfg), ray_worker_group_cls=group_cls,
                            train_dataset=placeholder, val_dataset=placeholder[:1])
    trainer.init_workers()
    trainer.checkpoint_manager.update_weights(0)  # engine <- initial actor weights (as fit() does first)
    rollout = vcfg.actor_rollout_ref.rollout
    n_gpus = vcfg.trainer.n_gpus_per_node * vcfg.trainer.nnodes
    return trainer, dict(
        rollout_manager=trainer.async_rollout_manager, actor=RayTrainerActor(trainer),
        checkpoint_manager=trainer.checkpoint_manager, tokenizer=model_config.tokenizer,
        processor=model_config.processor, divisor=rollout.agent.num_workers, dp_size=n_gpus,
        micro_batch_size_per_gpu=vcfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu or 1,
        rollout_name=rollout.name, free_cache_engine=rollout.free_cache_engine)


class RayTrainerActor:
    """The actor side as VerlBackend calls it: RayPPOTrainer's DataProto<->TensorDict helpers plus the worker group."""

    def __init__(self, trainer):
        self.trainer, self.wg = trainer, trainer.actor_rollout_wg

    def update_actor(self, batch):
        """RayPPOTrainer._update_actor, with the mini-batch cut to the batch when the batch is smaller than one
        (VerlBackend's trimming keeps such a batch as one smaller optimizer step; verl asserts whole mini-batches)."""
        from omegaconf import open_dict

        actor = self.trainer.config.actor_rollout_ref.actor
        configured, groups = actor.ppo_mini_batch_size, len(batch) // self.trainer.config.actor_rollout_ref.rollout.n
        with open_dict(actor):
            actor.ppo_mini_batch_size = min(configured, groups)
        try:
            return self.trainer._update_actor(batch)
        finally:
            with open_dict(actor):
                actor.ppo_mini_batch_size = configured

    def compute_log_prob(self, batch):
        return self.trainer._compute_old_log_prob(batch)[0]

    def compute_ref_log_prob(self, batch):
        return self.trainer._compute_ref_log_prob(batch)

    def save_model_to_cpu(self, n):
        self.wg.save_model_to_cpu(n)

    def restore_model_from_cpu(self, n):
        self.wg.restore_model_from_cpu(n)

    def clear_cpu_model(self, n):
        self.wg.clear_cpu_model(n)

    def save_checkpoint(self, local_path, global_step=0):
        self.wg.save_checkpoint(local_path, None, global_step, None)

    def load_checkpoint(self, local_path):
        self.wg.load_checkpoint(local_path, None, False)


def run(cfg, vcfg):
    """Driver (inside the Ray task runner): `bapo_vl.train.train`, the same loop, run record and checkpoints as
    the embedded backend, over a VerlBackend built from verl's real workers."""
    from bapo_vl.backends.verl_backend import VerlBackend
    from bapo_vl.train import train

    _, workers = build_verl_workers(vcfg)
    return train(cfg, quiet=True, backend=VerlBackend(cfg, task_name=cfg.task, **workers))


def main(argv=None):
    ap = argparse.ArgumentParser(description="BAPO on verl 0.9.1 (Ray + FSDP + vLLM)")
    ap.add_argument("--config", required=True, help="a presets/verl_*.yaml file")
    ap.add_argument("overrides", nargs="*", help="bapo.KEY=VALUE or verl.DOTTED.KEY=VALUE")
    args = ap.parse_args(argv)
    cfg, vcfg = load_configs(args.config, args.overrides)
    import ray
    from verl.trainer.main_ppo import run_ppo  # noqa: F401  (ray runtime env helpers live with it)

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true"}})
    ray.get(ray.remote(num_cpus=1)(run).remote(cfg, vcfg))


if __name__ == "__main__":
    main()
