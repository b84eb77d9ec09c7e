"""What the CPU tests cannot show about the embedded backend's vLLM rollout engine (`rollout_engine=vllm`), checked on
a GPU. Needs bapo-vl installed with its vLLM extra (`pip install -e ".[vllm]"`).

    python scripts/gpu/engine_checks.py [--preset NAME] [KEY=VALUE ...]    # default: the tiny preset on cuda
    python scripts/gpu/engine_checks.py --preset geometry3k model=DIR "task_options={source: G3K}"   # Qwen2.5-VL

The engine's own log-probs of a fixed probe (prompts + responses it sampled), read back from vLLM with
`prompt_logprobs` (VL: the log-probs vLLM reports for freshly sampled tokens, since a VL prompt goes in as text and
images), are compared with the trainer's teacher-forced log-probs of the same tokens under the stale rollout
policy alpha (`backend.rollout`) and under pi_theta (`backend.policy`):

  copy       before any update (alpha and pi_theta hold the same weights) the trainer's alpha copy scores every
             sampled token as the model the update computes with does, within COPY_TOLERANCE (the largest
             difference, not the mean: a few tokens far off make ratios far from 1)
  behaviour  the stored behaviour log-probs (what `generate` returns) equal the engine's log-probs of the sampled
             tokens within TOLERANCE (bf16 engine vs the trainer's bf16 autocast forward of the same weights), or
             within BF16_SCALE x the trainer's own bf16-vs-fp32 distance where that is larger (two bf16 forwards,
             each about that far from fp32; the distance is printed too)
  stale      after an update without a sync the engine still matches alpha, not pi_theta
  x2         a re-evaluation (policy="current") samples from pi_theta: its greedy answers are pi_theta's, not alpha's;
             afterwards the engine matches alpha again
  sleep      sleep (update) + wake leave the engine's weights unchanged
  sync       after `sync()` the engine matches pi_theta

Prints one JSON line per figure and PASS/FAIL per check; exits 1 if any check fails.
"""
from __future__ import annotations

import json
import sys

TOLERANCE = 0.05  # mean |log-prob difference| per token: bf16 vLLM vs the trainer's bf16 forward of the same weights
BF16_SCALE = 2.0  # behaviour: two bf16 implementations may each be the trainer's own bf16 error away from fp32
SEPARATION = 2.0  # the wrong weights must be at least this many times further off than the right ones
COPY_TOLERANCE = 1e-3  # largest |log-prob difference| of any token between alpha's copy and pi_theta at equal weights


def emit(**fields):
    print(json.dumps(fields), flush=True)


def engine_logprobs(engine, prompts, responses) -> list[list[float]]:
    """vLLM's log-probs of each response's tokens given its prompt (one forward, `prompt_logprobs`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    seqs = [TokensPrompt(prompt_token_ids=p["input_ids"].tolist() + list(r)) for p, r in zip(prompts, responses)]
    outs = engine.llm.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
    result = []
    for p, r, out in zip(prompts, responses, outs):
        P = len(p["input_ids"])
        result.append([out.prompt_logprobs[P + j][tok].logprob for j, tok in enumerate(r)])
    return result


def engine_samples(engine, prompts, n: int) -> tuple[list[dict], list[list[int]], list[list[float]]]:
    """n fresh samples per prompt from the engine's current weights with vLLM's log-prob of each sampled token:
    (prompt per sample, tokens, log-probs), each cut after its first EOS as the engine cuts them."""
    from bapo_vl.backends.engines import cut_at_eos

    params = engine.sampling(n)
    params.logprobs = 0  # the sampled token's own log-prob (vLLM's raw log-probs: temperature 1 in these checks)
    outs = engine.llm.generate(engine.inputs(prompts), params, use_tqdm=False)
    flat_prompts, tokens, logprobs = [], [], []
    for p, out in zip(prompts, outs):
        for o in out.outputs:
            t = cut_at_eos(list(o.token_ids), engine.backend.eos_ids)
            flat_prompts.append(p)
            tokens.append(t)
            logprobs.append([o.logprobs[j][tok].logprob for j, tok in enumerate(t)])
    return flat_prompts, tokens, logprobs


def distance(a: list[list[float]], b) -> float:
    """Mean |a - b| per token; b is a (N, R) tensor right-padded, or lists like a."""
    total = n = 0
    for i, row in enumerate(a):
        for j, x in enumerate(row):
            total += abs(x - float(b[i][j]))
            n += 1
    return total / n


def largest(a: list[list[float]], b) -> float:
    """Largest |a - b| of any token; b as for `distance`."""
    return max((abs(x - float(b[i][j])) for i, row in enumerate(a) for j, x in enumerate(row)), default=0.0)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two greedy answers agree, up to the first difference (prefix agreement)."""
    same = total = 0
    for x, y in zip(a, b):
        k = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        same += k
        total += max(len(x), len(y))
    return same / max(total, 1)


def main(argv: list[str]) -> int:
    import torch

    from bapo_vl.backends.base import UpdateBatch
    from bapo_vl.backends.engines import TransformersEngine
    from bapo_vl.config import load_config
    from bapo_vl.train import load_problems, make_backend

    preset = argv[argv.index("--preset") + 1] if "--preset" in argv else "tiny"
    argv = [a for i, a in enumerate(argv) if a != "--preset" and (i == 0 or argv[i - 1] != "--preset")]
    cfg = load_config(preset, None, ["device=cuda", "rollout_engine=vllm", "delay=5", "lr=3e-3", "temperature=1.0",
                                     *argv])
    backend = make_backend(cfg)
    engine = backend.engine
    emit(engine=engine.name, model=cfg.run.model, card=torch.cuda.get_device_name(0))
    assert engine.name == "vllm", engine.name
    _, problems = load_problems(cfg.run)
    prompts = [backend.encode(p) for p in problems[:16]]
    results: dict[str, bool] = {}

    def check(name: str, ok: bool, **figures):
        results[name] = bool(ok)
        emit(check=name, ok=bool(ok), **figures)

    def probe_distances():
        if backend.is_vl:  # fresh samples from the engine's weights, scored by both of the trainer's models
            ps, toks, eng = engine_samples(engine, prompts, 1)
            return (distance(eng, backend.score(backend.rollout, ps, toks)),
                    distance(eng, backend.score(backend.policy, ps, toks)))
        eng = engine_logprobs(engine, prompts, probe)
        return (distance(eng, backend.score(backend.rollout, prompts, probe)),
                distance(eng, backend.score(backend.policy, prompts, probe)))

    # behaviour: what generate() stores is the engine's log-prob of what it sampled
    groups = backend.generate(prompts, 4)
    if backend.is_vl:  # generate() stores score(alpha) of the engine's tokens: the same, on samples with vLLM's own
        flat_prompts, tokens, eng = engine_samples(engine, prompts, 4)
        stored = backend.score(backend.rollout, flat_prompts, tokens).tolist()
    else:
        flat_prompts = [p for p in prompts for _ in range(4)]
        flat = [r for g in groups for r in g]
        tokens = [list(r.tokens) for r in flat]
        stored = [list(r.logprobs) for r in flat]
        eng = engine_logprobs(engine, flat_prompts, tokens)
    theta = backend.score(backend.trained, flat_prompts, tokens)
    scored = backend.score(backend.rollout, flat_prompts, tokens).tolist()
    alpha = [list(row[:len(t)]) for row, t in zip(scored, tokens)]
    copy_gap = largest(alpha, theta)
    check("copy", copy_gap <= COPY_TOLERANCE, max_abs_diff=copy_gap, mean_abs_diff=distance(alpha, theta),
          tokens=sum(map(len, tokens)))
    d = distance(eng, stored)
    # for scale, what bf16 alone moves on the trainer's side: its fp32 forward of the same weights (pi_theta = alpha
    # before any update; alpha's copy under bf16 autocast is what generate() scores with)
    autocast, backend.autocast_dtype = backend.autocast_dtype, None
    try:
        fp32 = backend.score(backend.policy, flat_prompts, tokens)
    finally:
        backend.autocast_dtype = autocast
    stored = [list(row[:len(t)]) for row, t in zip(stored, tokens)]  # VL: score()'s rows are right-padded
    bf16 = distance(stored, fp32)
    tolerance = max(TOLERANCE, BF16_SCALE * bf16)
    check("behaviour", d < tolerance, mean_abs_diff=d, max_abs_diff=largest(eng, stored), tolerance=tolerance,
          tokens=sum(map(len, eng)),
          trainer_bf16_vs_fp32=bf16, engine_vs_trainer_fp32=distance(eng, fp32))
    probe = [g[0].tokens for g in groups]

    # move pi_theta away from alpha: a few large-lr updates on the sampled groups, no sync
    rewards = tuple(tuple(float(i % 2) for i in range(4)) for _ in groups)
    advantages = tuple(tuple(1.0 if i % 2 else -1.0 for i in range(4)) for _ in groups)
    for step in range(3):
        backend.update(UpdateBatch(prompts=tuple(prompts), responses=tuple(tuple(g) for g in groups), rewards=rewards,
                                   advantages=advantages, step=step + 1))
    to_alpha, to_theta = probe_distances()
    check("stale", to_alpha < tolerance and to_theta > SEPARATION * to_alpha, engine_vs_alpha=to_alpha,
          engine_vs_pi_theta=to_theta)

    # x2: greedy answers of a re-evaluation are pi_theta's; then alpha is back
    x2 = [list(r.tokens) for g in backend.generate(prompts, 1, "current", greedy=True, logprobs=False) for r in g]
    reference = TransformersEngine(backend)  # model.generate on the trainer's own pi_theta and alpha
    ref = {name: reference.sample(prompts, 1, policy, greedy=True)
           for name, policy in (("pi_theta", "current"), ("alpha", "rollout"))}
    a_theta, a_alpha = agreement(x2, ref["pi_theta"]), agreement(x2, ref["alpha"])
    after_alpha, after_theta = probe_distances()
    check("x2", a_theta > a_alpha and a_theta > 0.5 and after_alpha < tolerance and after_theta > SEPARATION * after_alpha,
          greedy_agreement_pi_theta=a_theta, greedy_agreement_alpha=a_alpha, after_engine_vs_alpha=after_alpha,
          after_engine_vs_pi_theta=after_theta)

    engine.sleep()
    engine.wake()
    s_alpha, _ = probe_distances()
    check("sleep", s_alpha < tolerance, engine_vs_alpha=s_alpha)

    backend.sync()
    y_alpha, y_theta = probe_distances()  # alpha == pi_theta now, in the backend and (if the sync worked) the engine
    check("sync", y_theta < tolerance, engine_vs_pi_theta=y_theta, engine_vs_alpha=y_alpha)

    emit(summary={k: "PASS" if v else "FAIL" for k, v in results.items()})
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
