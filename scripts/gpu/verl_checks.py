"""What the CPU tests cannot show about the real verl path (Ray, FSDP actor, colocated vLLM), checked on a GPU.

    python scripts/gpu/verl_checks.py --config bapo_vl/presets/verl_tiny.yaml [bapo.KEY=V ...] [verl.KEY=V ...]
        [--no-resume]

Runs the BAPO Trainer over VerlBackend for a few steps and after each one compares the engine's log-probs of a
fixed probe (prompts + sampled responses) with the FSDP actor's log-probs of the same tokens under the weights of
the stale rollout policy alpha (the CPU snapshot) and under the current pi_theta:

  engine    at every probe the engine computes what the actor computes with alpha's weights, within TOLERANCE
            (any delay; with delay 1 and free_cache_engine=True, after each sleep and weight push)
  stale     between syncs the engine matches alpha, not pi_theta (after an update the two differ)
  x2        during a re-evaluation the engine generates with pi_theta, and after it matches alpha again
  behaviour the stored behaviour log-probs equal the engine's log-probs of the sampled tokens, within TOLERANCE
  resume    a checkpoint restores the buffers, the actor's weights exactly, and alpha in the engine

Prints one JSON line per figure and PASS/FAIL per check (SKIP where the config cannot exercise it: stale needs
bapo.delay > 1 and bapo.use_x2, under which the actor keeps alpha's weights; x2 also a re-evaluation within the
steps); exits 1 if any check fails.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile

TOLERANCE = 0.05  # mean |log-prob difference| per token: bf16 engine vs FSDP actor of the same weights
SEPARATION = 2.0  # the wrong weights must be at least this many times further off than the right ones


def emit(**fields):
    print(json.dumps(fields), flush=True)


def run(cfg, vcfg, resume: bool = True) -> int:
    import torch

    from bapo_vl.backends.base import UpdateBatch
    from bapo_vl.backends.verl_backend import ALPHA, CURRENT, build_verl_workers
    from bapo_vl.plugins import get_task
    from bapo_vl.train import make_trainer
    from bapo_vl.verl_launch import make_verl_backend

    _, workers = build_verl_workers(vcfg)
    backend = make_verl_backend(cfg, **workers)
    task = get_task(cfg.run.task, cfg.run.tasks_dirs)
    problems = task.load(split="train", **cfg.run.task_options)
    trainer = make_trainer(cfg, backend, task, problems)
    actor = backend.actor
    # the actor keeps alpha's weights as a CPU snapshot only with delay > 1 and X2; otherwise a probe first puts
    # pi_theta in the engine and compares the two at pi_theta (at delay 1 the next step's sync would do the same; at
    # delay > 1 without X2 it is an extra sync, and the steps after it sample from pi_theta)
    alpha_kept = backend.snapshots

    def actor_logprobs(prompts, responses, weights: str) -> list[torch.Tensor]:
        """The actor's log-probs of the given responses under alpha's or the current weights."""
        n, unit = len(responses), vcfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
        prompts, responses = list(prompts), list(responses)
        while len(responses) % unit:  # verl's compute_log_prob takes whole micro-batches only
            prompts.append(prompts[-1])
            responses.append(responses[-1])
        batch = UpdateBatch(tuple(prompts), tuple((r,) for r in responses), tuple((0.0,) for _ in responses),
                            tuple((0.0,) for _ in responses))
        data = backend.batch_to_dataproto(batch)
        if weights == "alpha":
            actor.save_model_to_cpu(CURRENT)
            actor.restore_model_from_cpu(ALPHA)
        try:
            lp = actor.compute_log_prob(data).batch["old_log_probs"]
        finally:
            if weights == "alpha":
                actor.restore_model_from_cpu(CURRENT)
                actor.clear_cpu_model(CURRENT)
        return [lp[i, :len(r.tokens)].float().cpu() for i, r in enumerate(responses[:n])]

    def gap(engine: list, actor_lp: list) -> float:
        diffs = torch.cat([(torch.tensor(e.logprobs) - a).abs() for e, a in zip(engine, actor_lp)])
        return float(diffs.mean())

    probe_prompts = [backend.encode(p) for p in problems[:8]]

    def probe(step: int, label: str) -> dict:
        if not alpha_kept:
            backend.sync()
        out = backend.generate(probe_prompts, 1, policy="rollout")  # what the engine holds now
        responses = [g[0] for g in out]
        current = gap(responses, actor_logprobs(probe_prompts, responses, "current"))
        figures = {"step": step, "when": label, "policy_version": trainer.updates,
                   "rollout_version": trainer.rollout_version,
                   "gap_alpha": gap(responses, actor_logprobs(probe_prompts, responses, "alpha")) if alpha_kept
                   else current,
                   "gap_current": current}
        emit(check="probe", **figures)
        return figures

    # X2: inside the re-evaluation's generate the engine must hold pi_theta (actor's current weights)
    reeval = []
    generate = backend.generate

    def watched_generate(prompts, n, policy="rollout", **kw):
        out = generate(prompts, n, policy=policy, **kw)
        if policy == "current":
            flat = [r for g in out for r in g]
            flat_prompts = [p for p, g in zip(prompts, out) for _ in g]
            reeval.append({"current": gap(flat, actor_logprobs(flat_prompts, flat, "current")),
                           "alpha": gap(flat, actor_logprobs(flat_prompts, flat, "alpha")) if alpha_kept else None})
            emit(check="x2_generation", step=trainer_step[0], **reeval[-1])
        return out

    backend.generate = watched_generate
    trainer_step = [0]
    probes, stored = [probe(0, "before the first step")], []
    for t in range(1, cfg.run.steps + 1):
        trainer_step[0] = t
        result = trainer.step(t)
        m = result.metrics
        emit(check="step", step=t, x1=m["x1"], x2=m["x2"], x3=m["x3"], reevaluated=len(result.reevaluated),
             loss=m.get("loss"), kl=m.get("kl"), entropy=m.get("entropy"), clip_frac=m.get("clip_frac"),
             grad_norm=m.get("grad_norm"), t_generate=m["t_generate"], t_train=m["t_train"], t_sync=m["t_sync"])
        # behaviour: the stored log-probs of this step's fresh groups vs the actor under alpha (their policy)
        groups = [g for g in result.fresh if g.version == trainer.rollout_version][:8]
        if groups and alpha_kept and trainer.rollout_version != trainer.updates:
            from bapo_vl.backends.base import Response

            resp = [Response(tuple(g.samples[0].tokens), tuple(g.samples[0].logprobs)) for g in groups]
            prompts = [backend.encode(g.problem) for g in groups]
            stored.append(gap(resp, actor_logprobs(prompts, resp, "alpha")))
            emit(check="behaviour", step=t, gap_alpha=stored[-1])
        probes.append(probe(t, "after step"))

    ok = True

    def verdict(name: str, passed: bool, skip: str = "", **figures):
        nonlocal ok
        if skip:
            emit(check=name, result="SKIP", why=skip)
            return
        ok &= bool(passed)
        emit(check=name, result="PASS" if passed else "FAIL", **figures)

    verdict("engine", all(p["gap_alpha"] < TOLERANCE for p in probes), steps=[p["step"] for p in probes],
            gap_alpha=[p["gap_alpha"] for p in probes], tolerance=TOLERANCE)
    no_alpha = "" if alpha_kept else "alpha is not kept (only with bapo.delay > 1 and bapo.use_x2)"
    stale = [p for p in probes if p["rollout_version"] != p["policy_version"]]
    verdict("stale", all(p["gap_alpha"] < TOLERANCE and p["gap_current"] > SEPARATION * p["gap_alpha"] for p in stale),
            skip=no_alpha or ("" if stale else "no probe between syncs"),
            steps=[p["step"] for p in stale], gap_alpha=[p["gap_alpha"] for p in stale],
            gap_current=[p["gap_current"] for p in stale])
    verdict("x2", all(r["current"] < TOLERANCE and r["alpha"] > SEPARATION * r["current"] for r in reeval),
            skip=no_alpha or ("" if reeval else "no re-evaluation within the steps"), during=reeval)
    verdict("behaviour", bool(stored) and max(stored) < TOLERANCE, gap_alpha=stored, tolerance=TOLERANCE,
            skip=no_alpha)

    if not resume:
        verdict("resume", False, skip="--no-resume")
        return 0 if ok else 1
    # resume: checkpoint, move on, load it back
    with tempfile.TemporaryDirectory() as tmp:
        state = copy.deepcopy(trainer.state_dict())
        backend.save_checkpoint(tmp, cfg.run.steps)
        fixed = [g[0] for g in backend.generate(probe_prompts, 1)]
        before = actor_logprobs(probe_prompts, fixed, "current")
        engine_gap_before = probe(cfg.run.steps, "before checkpoint load")["gap_alpha"]
        trainer.step(cfg.run.steps + 1)  # actor, engine, buffers all move on
        trainer.load_state_dict(copy.deepcopy(state))
        backend.load_checkpoint(tmp)
        after = actor_logprobs(probe_prompts, fixed, "current")
        actor_same = max(float((a - b).abs().max()) for a, b in zip(after, before))
        restored = probe(cfg.run.steps, "after checkpoint load")
        verdict("resume", actor_same < 1e-6 and restored["gap_alpha"] < TOLERANCE
                and list(trainer.state.bad.groups) == state["bad"]["uids"]
                and list(trainer.state.high.groups) == state["high"]["uids"],
                actor_max_diff=actor_same, engine_gap_alpha_before=engine_gap_before,
                engine_gap_alpha_after=restored["gap_alpha"], bad=len(trainer.state.bad), high=len(trainer.state.high))
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--no-resume", action="store_true",
                    help="skip the resume check (it writes a whole actor checkpoint: fp32 weights and AdamW state)")
    args = ap.parse_args()
    import os

    import ray

    from bapo_vl.backends.verl_main import load_configs

    cfg, vcfg = load_configs(args.config, args.overrides)
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true"}})
    sys.exit(ray.get(ray.remote(num_cpus=1)(run).remote(cfg, vcfg, not args.no_resume)))


if __name__ == "__main__":
    main()
