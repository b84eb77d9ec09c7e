"""Countdown: combine the given numbers with + - * / (each exactly once) to reach the target."""
from __future__ import annotations

import logging
import random
from fractions import Fraction
from pathlib import Path

from bapo_vl.datafiles import parse_rows
from bapo_vl.problem import Problem
from bapo_vl.verifiers.countdown import VERIFIER_VERSION as VERSION  # noqa: F401  (recorded with each run)
from bapo_vl.verifiers.countdown import verify  # noqa: F401  (the plugin's verify)

NAME = "countdown"
log = logging.getLogger("bapo_vl.tasks.countdown")

OPS = "+-*/"


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction | None:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b if b != 0 else None


def random_expression(nums: list[int], rng: random.Random) -> tuple[str, Fraction | None]:
    """A random binary expression tree over all of `nums` (each once), as (text, exact value)."""
    items = [(str(n), Fraction(n)) for n in nums]
    rng.shuffle(items)
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (ta, va), (tb, vb) = items[i], items[j]
        op = rng.choice(OPS)
        value = None if va is None or vb is None else _apply(op, va, vb)
        items = [it for k, it in enumerate(items) if k not in (i, j)]
        items.append((f"({ta}{op}{tb})", value))
    text, value = items[0]
    return (text[1:-1] if text.startswith("(") else text), value


def generate_problems(n: int, seed: int = 0, min_target: int = 10, max_target: int = 100):
    """`n` problems made forward: 3-4 random numbers in 1..99, a random expression over all of them, kept
    when its value is an integer target in [min_target, max_target]. Yields (nums, target, solution)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        nums = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        text, value = random_expression(nums, rng)
        if value is not None and value.denominator == 1 and min_target <= value <= max_target:
            out.append((nums, int(value), text))
    return out


# TinyZero's prompts (Jiayi-Pan/TinyZero examples/data_preprocess/countdown.py), verbatim.
_QUESTION = ("Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic "
             "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> "
             "tags. And return the final answer in <answer> </answer> tags, for example "
             "<answer> (1 + 2) / 3 </answer>.")
_SYSTEM = ("You are a helpful assistant. You first thinks about the reasoning process in the mind and then "
           "provides the user with the answer.")
_BASE = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
         "The assistant first thinks about the reasoning process in the mind and then provides the user with "
         "the answer.\nUser: {question}\nAssistant: Let me solve this step by step.\n<think>")
# TinyZero's qwen-instruct prompt also opens the assistant turn with this; chat messages cannot carry it.
CHAT_ASSISTANT_PREFIX = "Let me solve this step by step.\n<think>"

TEMPLATES = {
    "compact": lambda nums, target: [{"role": "user", "content": f"{' '.join(map(str, nums))} -> {target}"}],
    "tinyzero": lambda nums, target: [
        {"role": "user", "content": _BASE.format(question=_QUESTION.format(nums=list(nums), target=target))}],
    # The leading space is TinyZero's: rendered with Qwen's chat template this is its prompt text exactly.
    "chat": lambda nums, target: [{"role": "system", "content": _SYSTEM},
                                  {"role": "user", "content": " " + _QUESTION.format(nums=list(nums), target=target)}],
}
TRAIN_SIZE, TEST_SIZE, EVAL_SIZE = 10_000, 1_024, 200
EVAL_SIZES = {"cd34": (3, 4), "cd4": (4,)}  # evaluation split -> allowed counts of numbers
EVAL_SPLITS = list(EVAL_SIZES)  # the paper's CD-34 and CD-4 (200 problems each)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _fields(row) -> tuple[list[int], int, int | None]:
    """(nums, target, index) of a raw {target, nums[, row]} or TinyZero-preprocessed row; ValueError if malformed."""
    if not isinstance(row, dict):
        raise ValueError(f"expected an object, got {type(row).__name__}")
    truth = (row.get("reward_model") or {}).get("ground_truth") or {}
    nums = row.get("nums", truth.get("numbers"))
    target = row.get("target", truth.get("target"))
    if not isinstance(nums, list) or not nums or not all(_is_int(n) and n >= 0 for n in nums):
        raise ValueError(f"nums must be a non-empty list of non-negative integers, got {nums!r}")
    if not _is_int(target):
        raise ValueError(f"target must be an integer, got {target!r}")
    if truth and (truth.get("numbers", nums) != nums or truth.get("target", target) != target):
        raise ValueError("nums/target disagree with reward_model.ground_truth")
    index = row.get("row", (row.get("extra_info") or {}).get("index"))
    if index is not None and not _is_int(index):
        raise ValueError(f"row index must be an integer, got {index!r}")
    return nums, target, index


def _records(source, skip_bad: bool) -> list[tuple[list[int], int, int | None, int]]:
    """(nums, target, index, row number) of every well-formed row of `source`."""
    return [(*fields, i) for i, _, fields in parse_rows(Path(source), _fields, skip_bad, "countdown")]


def load(split: str = "train", source: str | None = None, template: str = "chat", limit: int | None = None,
         seed: int = 42, skip_bad: bool = False) -> list[Problem]:
    """Countdown problems. `source=None`: generated (train: 10,000 with `seed`; test: 1,024 with `seed+1`).
    `source`: a .jsonl/.json/.parquet file of raw or TinyZero rows (`split` train/test: the whole file).
    `split` cd34/cd4: a seeded choice of 200 problems with 3-4 / 4 numbers, from `source` or the generated
    test set. uid: `countdown-{index}` from the row's `row`/`extra_info.index`, else `countdown-{nums}-{target}`
    (e.g. countdown-44_19_35-98); repeats of a uid within a load get `#2`, `#3`, ... in file order."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; have {', '.join(TEMPLATES)}")
    if split not in ("train", "test", *EVAL_SPLITS):
        raise ValueError(f"unknown split {split!r}; have train, test, {', '.join(EVAL_SPLITS)}")
    if source is None:
        # generate_problems is prefix-stable, so a limit only shortens the run
        n = TRAIN_SIZE if split == "train" else TEST_SIZE
        n = min(n, limit) if limit is not None and split in ("train", "test") else n
        gen_seed = seed if split == "train" else seed + 1
        records = [(nums, target, None, i, {"solution": text, "seed": gen_seed})
                   for i, (nums, target, text) in enumerate(generate_problems(n, seed=gen_seed))]
    else:
        records = [(*r, {"source": str(source)}) for r in _records(source, skip_bad)]

    problems, seen = [], {}
    for nums, target, index, i, meta in records:
        uid = f"countdown-{index}" if index is not None else f"countdown-{'_'.join(map(str, nums))}-{target}"
        seen[uid] = seen.get(uid, 0) + 1
        if seen[uid] > 1:
            uid = f"{uid}#{seen[uid]}"
        problems.append(Problem(uid=uid, messages=TEMPLATES[template](nums, target),
                                answer={"nums": list(nums), "target": target},
                                meta={"row": i, "index": index, **meta}))
    if split in EVAL_SPLITS:
        pool = [p for p in problems if len(p.answer["nums"]) in EVAL_SIZES[split]]
        chosen = random.Random(seed).sample(range(len(pool)), min(EVAL_SIZE, len(pool)))
        problems = [pool[k] for k in sorted(chosen)]
    return problems[:limit] if limit is not None else problems
