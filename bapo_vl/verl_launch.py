"""`bapo train backend=verl` (e.g. `bapo train --preset verl_math`): BAPO on verl 0.9.1 (Ray + FSDP + vLLM).

The verl backend's launcher (config.BACKENDS): verl's ppo_trainer config is composed from ours (`compose`), then the
driver runs inside a Ray task (`run`): `bapo_vl.train.train`, the same loop, run record and checkpoints as the
embedded backend, over a VerlBackend built from verl's real workers (verl_backend.build_verl_workers).

Pattern: verl-recipe's DAPO (`RayDAPOTrainer(RayPPOTrainer)` with its own step loop, started by
`run_ppo(config, task_runner_class=...)`). We take the legacy `RayPPOTrainer` (trainer.use_v1=false) because its
`init_workers()` builds exactly the three objects BAPO needs (actor worker group, AgentLoopManager, checkpoint engine
manager) and keeps batches in the driver: BAPO's buffers hold groups across steps, which the V1 TransferQueue
trainer clears every step. The step loop is NOT verl's `fit()`: it is bapo_vl.trainer.Trainer over VerlBackend.

One place per setting: everything our Config decides is written into verl's config by `derived_settings`, and a
`verl.` key of the same is refused. The `verl` field (VerlOptions) says only how verl runs: parallelism, memory,
engine. On CPU (no vLLM), tests check the config composed here and that verl_backend.RayTrainerActor forwards to
verl's real method signatures; `run` and `launch` run on the GPU machines (docs/verl.md, scripts/gpu/verl_checks.py).
"""
from __future__ import annotations

import os
from pathlib import Path

from bapo_vl.config import Config, ConfigError, as_override


def derived_settings(cfg: Config) -> dict[str, tuple[str, object]]:
    """verl keys decided by our Config: {dotted verl key: (our field, value)}. One place per setting: a `verl.`
    override of any of these is refused."""
    from bapo_vl.backends import verl_data
    from bapo_vl.backends.verl_loss import actor_settings
    from bapo_vl.models import resolve_model

    out = {f"actor_rollout_ref.actor.{k}": v for k, v in actor_settings(cfg.optim, cfg.loss).items()}
    sampling = cfg.sampling
    rollout = "actor_rollout_ref.rollout."
    out.update({
        "trainer.use_v1": ("(BAPO needs the legacy trainer)", False),
        "algorithm.adv_estimator": ("(the Trainer computes GRPO advantages)", "grpo"),
        "critic.enable": ("critic (BA-PPO is embedded-only)", False),
        "actor_rollout_ref.model.path": ("model", resolve_model(cfg.run.model)),  # bundled names as the embedded one
        rollout + "calculate_log_probs": ("(BAPO needs behaviour log-probs)", True),
        "actor_rollout_ref.actor.calculate_entropy": ("(the run record's entropy column)", True),
        rollout + "n": ("group_size", sampling.group_size),
        rollout + "temperature": ("temperature", sampling.temperature),
        rollout + "top_p": ("top_p", sampling.top_p),
        rollout + "top_k": ("top_k", sampling.top_k),
        rollout + "prompt_length": ("max_prompt_length", sampling.max_prompt_length),
        rollout + "response_length": ("max_response_length", sampling.max_response_length),
        "data.max_prompt_length": ("max_prompt_length", sampling.max_prompt_length),
        "data.max_response_length": ("max_response_length", sampling.max_response_length),
        "data.train_batch_size": ("batch_size", sampling.batch_size),
        "trainer.total_training_steps": ("steps", cfg.run.steps),
        "reward.custom_reward_function.path": ("(our verifiers)", str(Path(verl_data.__file__))),
        "reward.custom_reward_function.name": ("(our verifiers)", "compute_score"),
    })
    return out


def compose(cfg: Config):
    """verl's ppo_trainer config (OmegaConf) for `cfg`: Hydra composes verl's defaults with cfg.verl.overrides, then
    every derived setting is written in. A `verl.` key that our config decides is refused, naming the field to set."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    import verl

    derived = derived_settings(cfg)
    for key in cfg.verl.overrides:
        if key.lstrip("+") in derived:
            source = derived[key.lstrip("+")][0]
            name, _, note = source.partition(" ")
            raise ConfigError(f"verl.{key} is fixed by BAPO {source}" if source.startswith("(") else
                              f"verl.{key} is set from our config: use {name}= instead" + (f" {note}" if note else ""),
                              "verl")
    # a value is Hydra's override text: a string as written (the command line's), others as YAML writes them
    overrides = [f"{k}={v if isinstance(v, str) else as_override(v)}" for k, v in cfg.verl.overrides.items()]
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        vcfg = hydra_compose(config_name="ppo_trainer", overrides=overrides)
    OmegaConf.set_struct(vcfg, False)
    for key, (_, value) in derived.items():
        OmegaConf.update(vcfg, key, value, merge=False)
    # resolved as verl's TaskRunner.run resolves it: a worker turns its part into a dataclass, where an
    # interpolation such as the actor profiler's ${oc.select:global_profiler.save_path} would fall to its default
    OmegaConf.resolve(vcfg)
    return vcfg


def make_verl_backend(cfg: Config, **workers):
    """A VerlBackend over `workers` (verl_backend.build_verl_workers'), given the groups of `cfg` it reads."""
    from bapo_vl.backends.verl_backend import VerlBackend

    return VerlBackend(cfg.sampling, cfg.optim, cfg.loss, task_name=cfg.run.task, delay=cfg.bapo.delay,
                       use_x2=cfg.bapo.use_x2, **workers)


def run(cfg: Config, vcfg) -> Path:
    """The driver, inside the Ray task runner: bapo_vl.train.train over a VerlBackend of verl's real workers."""
    from bapo_vl.backends.verl_backend import build_verl_workers
    from bapo_vl.train import train

    _, workers = build_verl_workers(vcfg)
    return train(cfg, quiet=True, backend=make_verl_backend(cfg, **workers))


def launch(cfg: Config, quiet: bool = False) -> Path:
    """Run `cfg` on verl: its config composed (and checked) here, then `run` in a Ray task on the Ray cluster at
    RAY_ADDRESS, or on one started on this machine's GPUs. Returns the run directory. The driver trains quietly, as
    a Ray task (`bapo runs show RUN` or the dashboard follow the run)."""
    vcfg = compose(cfg)
    if not os.environ.get("RAY_ADDRESS"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("backend=verl: verl's workers run on CUDA GPUs and torch sees none here; run on a GPU "
                              "machine, or on a Ray cluster that has them (RAY_ADDRESS=...)", "backend")
    import ray
    from verl.trainer.main_ppo import run_ppo  # noqa: F401  (ray runtime env helpers live with it)

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true"}})
    return ray.get(ray.remote(num_cpus=1)(run).remote(cfg, vcfg))
