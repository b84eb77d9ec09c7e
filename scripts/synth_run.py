"""Write a synthetic but realistic BAPO run record, e.g. for the dashboard benchmark (40,000 prompts x 500 steps).

    python scripts/synth_run.py /tmp/synth --prompts 40000 --steps 500       # -> /tmp/synth/run.db

No model: each prompt i has a latent difficulty a_i and the policy a skill s(t) that grows over the run; a group of
G responses has Binomial(G, sigmoid(a_i + s)) correct. The batch is then built with BAPO's rules, step by step,
so the record has the rows a real run writes (bapo_vl/record.py): per step B fresh groups (`x1` kept by the
range filter 1/G <= mu <= (G-1)/G, `filtered` dropped), every m steps up to `reeval_max` B_bad groups
re-generated with the current policy (`x2` promoted when c1 < mu_new < 1, `not_promoted` otherwise), `x3`
replays of B_high groups of the last 3 steps filling the batch up to B; thresholds c2/c3 from the real
`bapo_vl.algorithm.Thresholds` (eq. 8); the metrics the trainer logs (bins, buffer sizes, rollouts, rewards,
loss terms, KL, grad norm, importance ratio, timings split into generate/verify/train/sync, verdicts), a few
sampled responses per step, and a held-out evaluation every 25 steps. `--images` attaches a small PNG diagram to
the prompts whose responses are sampled (as a Geometry3K record has one per prompt). `--sleep S` writes one step
every S seconds (a live run for the dashboard: it holds the run directory's lock, as a trainer does, so readers
show it as running).
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from bapo_vl.algorithm import Thresholds
from bapo_vl.problem import Problem
from bapo_vl.record import FILTERED, NOT_PROMOTED, X1, X2, X3, RunRecord, lock_run_dir

SAMPLED_EVERY = 20  # responses are sampled (and, with --images, diagrams drawn) for every 20th prompt


def make_problems(n: int, images: bool, rng: random.Random) -> list[Problem]:
    problems = []
    for i in range(n):
        if images:  # Geometry3K-like: a diagram, a question and four choices
            a, b = rng.randint(3, 20), rng.randint(3, 20)
            right = round((a * a + b * b) ** 0.5, 1)  # AB ⟂ BC
            choices = sorted({right, float(a + b), float(abs(a - b) + 1), round(a * 1.5 + 0.3, 1)})
            text = f"In the diagram, AB ⟂ BC, AB = {a} and BC = {b}. Find AC. Choices: " + ", ".join(
                f"{'ABCD'[k]}. {c}" for k, c in enumerate(choices))
            answer = "ABCD"[choices.index(right)]
        else:
            nums = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
            target = rng.randint(10, 200)
            text = f"Using the numbers {nums}, create an equation that equals {target}. Use each number once."
            answer = {"target": target, "numbers": nums}
        problems.append(Problem(uid=f"synth-{i:06d}", messages=[{"role": "user", "content": text}], answer=answer,
                                images=[diagram(i)] if images and i % SAMPLED_EVERY == 0 else [],
                                meta={"index": i}))
    return problems


def diagram(i: int):
    """A small triangle diagram (PIL), different for each problem."""
    from PIL import Image, ImageDraw

    r = random.Random(i)
    img = Image.new("RGB", (160, 120), "white")
    d = ImageDraw.Draw(img)
    pts = [(r.randint(10, 60), r.randint(80, 110)), (r.randint(100, 150), r.randint(80, 110)),
           (r.randint(40, 120), r.randint(10, 40))]
    d.polygon(pts, outline="black")
    for (x, y), name in zip(pts, "ABC"):
        d.text((x + 3, y - 12), name, fill="blue")
    return img


class Sampler:
    """Shuffled passes over the prompt indices, like bapo_vl.trainer.PromptSampler."""

    def __init__(self, n: int, rng: np.random.Generator):
        self.n, self.rng = n, rng
        self.order, self.pos = rng.permutation(n), 0

    def next(self, k: int) -> np.ndarray:
        """k distinct prompts; at an epoch boundary, those this batch already has go last in the new order."""
        out: list[int] = []
        while len(out) < min(k, self.n):
            if self.pos == self.n:
                order, taken = self.rng.permutation(self.n), set(out)
                self.order = np.array([i for i in order if i not in taken] + [i for i in order if i in taken])
                self.pos = 0
            take = self.order[self.pos:self.pos + k - len(out)]
            out.extend(int(x) for x in take)
            self.pos += len(take)
        return np.array(out)


RESPONSES = {"correct": "<think>try {a} then adjust</think> <answer>{a}</answer>",
             "wrong": "<think>close enough?</think> <answer>{a}+1</answer>",
             "unparsable": "I think the answer is probably {a}",
             "timeout": "<answer>" + "9" * 40 + "**9**9</answer>"}


def synth(out: Path, prompts: int, steps: int, B: int = 256, G: int = 8, m: int = 5, delay: int = 5,
          reeval_max: int = 128, high_max_age: int = 3, images: bool = False, seed: int = 0, sleep: float = 0.0,
          name: str | None = None, quiet: bool = False, algo: str = "bapo") -> Path:
    """Write the record (see the module docstring); algo="grpo" keeps only the filtered fresh groups (no X2, no
    X3, on-policy). The simulated policy improves the same way under either algo: only the batch rules differ."""
    if algo not in ("bapo", "grpo"):
        raise ValueError(f"algo={algo!r}: bapo | grpo")
    use_x2 = use_x3 = algo == "bapo"
    delay = delay if algo == "bapo" else 1
    rng, prng = np.random.default_rng(seed), random.Random(seed)
    config = {"algo": algo, "task": "geometry3k" if images else "countdown", "model": "synthetic",
              "steps": steps, "batch_size": B, "group_size": G, "delay": delay, "reeval_every": m,
              "reeval_max": reeval_max, "high_max_age": high_max_age, "c1": 1 / G, "c2_range": [1 / 8, 4 / 8],
              "c3_range": [2 / 8, 5 / 8], "seed": seed, "synthetic": True}
    lock = lock_run_dir(out)  # held while writing, as a trainer holds it: readers show the run as running
    record = RunRecord.create(out, config, name=name or out.name, backend="synthetic")
    record.log_problems(make_problems(prompts, images, prng))
    # logit of the initial success probability: most prompts are within reach, a quarter are (nearly) out of it
    hard = rng.random(prompts) < 0.25
    difficulty = np.where(hard, rng.normal(-7.0, 1.2, prompts), rng.normal(-0.6, 1.8, prompts))
    skill = lambda t: 1.6 * t / max(steps, 1)  # the policy improves over the run
    p_solve = lambda idx, t: 1 / (1 + np.exp(-(difficulty[idx] + skill(t))))
    uid = lambda i: f"synth-{i:06d}"
    sampler, th = Sampler(prompts, rng), Thresholds(c1=1 / G, c2_range=tuple(config["c2_range"]),
                                                    c3_range=tuple(config["c3_range"]))
    bad: OrderedDict[int, int] = OrderedDict()  # B_bad: prompt -> correct count, oldest first (capacity B)
    high: dict[int, list[tuple[int, int]]] = {}  # B_high: step -> [(prompt, correct)]
    t0 = time.perf_counter()
    for t in range(1, steps + 1):
        c1, c2, c3 = th.c1, th.c2, th.c3
        idx = sampler.next(B)
        correct = rng.binomial(G, p_solve(idx, t - (t - 1) % delay))  # delayed rollout policy
        kept = (correct >= 1) & (correct <= G - 1)  # X1 filter: 1/G <= mu <= (G-1)/G
        groups = [(uid(i), int(c), G, X1 if k else FILTERED) for i, c, k in zip(idx, correct, kept)]
        x1 = int(kept.sum())
        for i, c in zip(idx, correct):  # store: B_bad (mu <= c1), B_high (c2 <= mu <= c3)
            if c / G <= c1 and use_x2:
                bad.pop(int(i), None)
                bad[int(i)] = int(c)
                while len(bad) > B:
                    bad.popitem(last=False)
            if c2 <= c / G <= c3 and use_x3:
                high.setdefault(t, []).append((int(i), int(c)))
        for s in [s for s in high if s <= t - high_max_age]:
            del high[s]
        in_batch = {int(i) for i, k in zip(idx, kept) if k}
        x2 = n_reeval = 0
        reeval_correct = []
        if t % m == 0 and bad:  # X2: re-generate the oldest B_bad prompts with the current policy
            old = [i for i in bad if i not in in_batch][:reeval_max]
            new = rng.binomial(G, p_solve(np.array(old), t))
            room = B - x1
            for i, c in zip(old, new):
                promoted = c1 < c / G < 1 and x2 < room
                groups.append((uid(i), int(c), G, X2 if promoted else NOT_PROMOTED))
                if promoted:
                    x2 += 1
                    del bad[i]
                    in_batch.add(i)
            n_reeval, reeval_correct = len(old), list(new)
        pool = [(i, c) for s in sorted(high) for i, c in high[s] if c2 <= c / G <= c3]
        prng.shuffle(pool)
        x3 = 0
        for i, c in pool:  # X3: fill the batch up to B with replays
            if x1 + x2 + x3 >= B:
                break
            if i not in in_batch:
                in_batch.add(i)
                groups.append((uid(i), c, G, X3))
                x3 += 1
        fresh_rewards = correct.sum() / (B * G)
        th.observe([1.0] * int(correct.sum()) + [0.0] * int(B * G - correct.sum()))
        batch_c = [c for _, c, _, s in groups if s in (X1, X2, X3)]
        n_resp = G * (B + n_reeval)
        right = int(correct.sum() + sum(reeval_correct))
        unparsable = int(rng.binomial(n_resp - right, 0.1))
        timeout = int(rng.binomial(n_resp - right - unparsable, 0.005))
        verdicts = {"correct": right, "wrong": n_resp - right - unparsable - timeout, "unparsable": unparsable,
                    "timeout": timeout}
        gen = float(rng.gamma(20, 2.5)) * (1 + n_reeval / B)
        metrics = {
            "step": t, "x1": x1, "x2": x2, "x3": x3, "batch_size": B, "trained_groups": x1 + x2 + x3,
            "bad_size": len(bad), "high_size": sum(len(v) for v in high.values()), "c1": c1, "c2": c2, "c3": c3,
            "r_tot": th.r_tot, "rollouts": n_resp, "rollouts_fresh": G * B,
            "rollouts_reevaluated": G * n_reeval,
            "fresh_reward": float(fresh_rewards),
            "reward": sum(batch_c) / (G * len(batch_c)) if batch_c else 0.0,
            "reevaluated_reward": sum(reeval_correct) / (G * n_reeval) if n_reeval else 0.0,
            "loss": (pg := float(rng.normal(0, 0.02))), "pg_loss": pg, "grad_norm": float(rng.gamma(8, 0.05)),
            "ratio_mean": 1 + float(rng.normal(0, 0.003)), "kl": 1e-3 * t / steps + float(rng.gamma(2, 1e-4)),
            "entropy": 0.9 - 0.3 * t / steps + float(rng.normal(0, 0.01)), "clip_frac": float(rng.beta(2, 60)),
            "policy_version": t - 1, "rollout_version": (t - 1) - (t - 1) % delay,
            "response_length": float(rng.normal(300, 20)),
            "t_generate": gen, "t_verify": float(rng.gamma(4, 0.5)), "t_train": float(rng.gamma(30, 0.8)),
            "t_sync": float(rng.gamma(10, 0.3)) if t % delay == 0 else 0.0,
        }
        samples = []
        sampled = [r for r in groups if r[3] in (X1, X2) and int(r[0][-6:]) % SAMPLED_EVERY == 0]
        for u, c, g, s in sorted(sampled, key=lambda r: r[3] != X2)[:4]:  # promoted X2 groups first
            for j in range(g):
                v = "correct" if j < c else prng.choice(["wrong", "wrong", "wrong", "unparsable", "timeout"])
                samples.append((u, s, j, RESPONSES[v].format(a=f"({prng.randint(1, 99)}*{prng.randint(1, 9)})"),
                                1.0 if v == "correct" else 0.0, v))
        record.log_step(t, metrics, groups=groups, samples=samples, verdicts=verdicts)
        if t % 25 == 0 or t == steps:
            for split, shift in ((("test", 0.0),) if images else (("cd34", 0.0), ("cd4", -0.8))):
                mean = 1 / (1 + math.exp(-(-1.0 + shift + skill(t))))
                record.log_eval(t, f"{config['task']}/{split}", {"n": 1024, "k": 8, "mean@k": mean,
                                                         "pass@k": 1 - (1 - mean) ** 8})
        if not quiet and (t % 50 == 0 or t == steps):
            print(f"step {t}/{steps}  |X1| {x1} |X2| {x2} |X3| {x3}  B_bad {len(bad)}  "
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
        if sleep:
            time.sleep(sleep)
    record.finish()
    record.close()
    lock.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="run directory to create (must not hold a run.db yet)")
    p.add_argument("--prompts", type=int, default=40000)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=256, help="B (default 256)")
    p.add_argument("--group-size", type=int, default=8, help="G (default 8)")
    p.add_argument("--reeval-every", type=int, default=5, help="m (default 5)")
    p.add_argument("--algo", choices=["bapo", "grpo"], default="bapo",
                   help="grpo: no X2/X3, on-policy (the simulated policy improves the same way)")
    p.add_argument("--images", action="store_true",
                   help="attach a small PNG diagram to the prompts whose responses are sampled (every 20th)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0, metavar="S", help="pause S seconds after each step (live)")
    p.add_argument("--name", default=None)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    out = synth(a.out, a.prompts, a.steps, B=a.batch_size, G=a.group_size, m=a.reeval_every, images=a.images,
                seed=a.seed, sleep=a.sleep, name=a.name, algo=a.algo)
    print(f"wrote {out / 'run.db'} in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
