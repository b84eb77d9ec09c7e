"""RL learns: `bapo train` on CPU raises a reward that the start policy earns only sometimes. A text task on the
bundled tiny policy (GRPO and BAPO) and an image task on a tiny random Qwen2.5-VL (GRPO). Each verifier rewards
a surface property of the response that the start policy already shows in part of its samples, so the rise is
reachable in a few steps; it is read from the run record (run.db's `steps.fresh_reward`)."""
import sqlite3
import textwrap
from contextlib import closing

import pytest

from bapo_vl.cli import main

SEED = 1
# Prompts in the compact countdown form the bundled policy was trained on. It opens "<answer>(" in about half of its
# responses and "<answer>" + a digit in the others; only the digit is rewarded. The reward depends on the 9th token alone,
# so 10 response tokens are enough.
TEXT_PLUGIN = '''
import random

from bapo_vl.problem import Problem, Verdict

NAME = "answer_opens_with_digit"


def load(split="train", source=None, n=256, seed=0):
    rng = random.Random(seed)
    problems = []
    for i in range(n):
        nums = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        text = f"{' '.join(map(str, nums))} -> {rng.randint(10, 100)}"
        problems.append(Problem(uid=f"opens-{i}", messages=[{"role": "user", "content": text}], answer=None))
    return problems


def verify(response, answer):
    return Verdict.CORRECT if response.startswith("<answer>") and response[8:9].isdigit() else Verdict.WRONG
'''

# Geodraw's diagrams and questions; a random model's first token is near-uniform over the 263 ids, so an ASCII
# letter or digit (62 of them) comes first in about a quarter of the responses.
VL_PLUGIN = '''
import string

from bapo_vl.plugins import get_task
from bapo_vl.problem import Verdict

NAME = "opens_with_alnum"


def load(split="train", source=None, limit=8):
    return get_task("geodraw").load(split=split, limit=limit)


def verify(response, answer):
    first = response[:1]
    return Verdict.CORRECT if first and first in string.ascii_letters + string.digits else Verdict.WRONG
'''


def write_plugin(root, name: str, source: str):
    (root / name).mkdir(parents=True)
    (root / name / "task.py").write_text(textwrap.dedent(source))
    return root


def fresh_rewards(run_dir) -> list[float]:
    with closing(sqlite3.connect(run_dir / "run.db")) as db:
        return [r for (r,) in db.execute("SELECT fresh_reward FROM steps ORDER BY step")]


def mean(xs) -> float:
    return sum(xs) / len(xs)


@pytest.mark.parametrize("algo", ["grpo", "bapo"])
def test_rl_raises_the_reward_of_the_tiny_text_policy(tmp_path, algo):
    # Could fail if the update pushed the wrong way (advantage sign, ratio inverted), if each token's log-prob were
    # read from the wrong hidden state (its own instead of the one before it), or if BAPO's delayed sync never
    # handed the trained weights to the rollout policy.
    plugins = write_plugin(tmp_path / "plugins", "answer_opens_with_digit", TEXT_PLUGIN)
    steps = 12  # BAPO's rollout policy is synced every 5 steps: its last 3 steps sample after the second sync
    assert main(["train", "task=answer_opens_with_digit", f"tasks_dirs=[{plugins}]", "task_options={}",
                 f"algo={algo}", f"seed={SEED}", f"steps={steps}", "batch_size=8", "group_size=8",
                 "mini_batch_size=8", "max_response_length=10", "lr=3e-4",
                 f"run_dir={tmp_path / 'runs'}", "name=r", "--quiet"]) == 0
    rewards = fresh_rewards(tmp_path / "runs" / "r")
    assert len(rewards) == steps
    assert 0.2 <= rewards[0] <= 0.7, rewards  # the start policy earns it sometimes: groups are mixed
    # 64 rollouts a step: the margin is several times a step's sampling noise, and holds over seeds
    assert mean(rewards[-3:]) >= mean(rewards[:3]) + 0.2, rewards
    assert mean(rewards[-3:]) >= 0.8, rewards  # most responses earn it now


def test_rl_raises_the_reward_of_a_tiny_qwen2_5_vl(tmp_path):
    # Could fail if the update pushed the wrong way, if the response's log-probs and mask were a column apart (the
    # first response token, the one rewarded here, left out of the loss), or if a VL policy's trained weights
    # never reached the rollout engine.
    from bapo_vl.tiny import build_qwen2_5_vl

    model, processor = build_qwen2_5_vl(max_pixels=112 * 112)  # a 224 px diagram becomes 16 image tokens
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    plugins = write_plugin(tmp_path / "plugins", "opens_with_alnum", VL_PLUGIN)
    steps = 12
    assert main(["train", "task=opens_with_alnum", f"tasks_dirs=[{plugins}]", "task_options={}",
                 f"model={tmp_path / 'vl'}", "algo=grpo", f"seed={SEED}", f"steps={steps}", "batch_size=8",
                 "group_size=8", "mini_batch_size=8", "micro_batch_size=64", "max_response_length=4",
                 "max_prompt_length=512", f"max_pixels={112 * 112}", "lr=3e-2",  # random weights: a large lr
                 f"run_dir={tmp_path / 'runs'}", "name=r", "--quiet"]) == 0
    rewards = fresh_rewards(tmp_path / "runs" / "r")
    assert len(rewards) == steps
    assert 0.1 <= rewards[0] <= 0.5, rewards
    assert mean(rewards[-3:]) >= mean(rewards[:3]) + 0.4, rewards
