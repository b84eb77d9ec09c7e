"""echo_digits: an example task plugin, outside the package. The prompt is a string of digits; a response is
correct when the digits in it, in order, are exactly those digits ("4 0 7" or "<answer>407</answer>" both echo
"407"). The contract it follows is the docstring of bapo_vl/plugins.py.

    bapo tasks --tasks-dir examples/task_plugin
    bapo train task=echo_digits "tasks_dirs=[examples/task_plugin]" "task_options={}"
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

from bapo_vl.problem import Problem, Verdict

NAME = "echo_digits"
EVAL_SPLITS = ["test"]  # what `bapo eval` evaluates by default (any split load() accepts can be named)
VERSION = "echo_digits-1"  # recorded with each run; bump it when verify() can judge a response differently

SIZES = {"train": 1000, "test": 100}


def _problem(i: int, digits: str) -> Problem:
    return Problem(uid=f"echo_digits-{digits}-{i}",  # stable across runs: it keys buffers and the run record
                   messages=[{"role": "user", "content": f"Repeat these digits: {digits}"}],
                   answer=digits)


def load(split: str = "train", source: str | None = None, length: int = 4, seed: int = 0,
         limit: int | None = None) -> list[Problem]:
    """`source=None`: random digit strings of `length` (train and test use different seeds).
    `source`: a JSONL file of {"digits": "407"} rows (the whole file, whatever the split)."""
    if split not in SIZES:
        raise ValueError(f"unknown split {split!r}; have {', '.join(SIZES)}")
    if source is not None:
        rows = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
        problems = [_problem(i, str(row["digits"])) for i, row in enumerate(rows)]
    else:
        rng = random.Random(seed + (split == "test"))
        problems = [_problem(i, "".join(rng.choice("0123456789") for _ in range(length)))
                    for i in range(SIZES[split])]
    return problems[:limit] if limit is not None else problems


def verify(response: str, answer: str) -> Verdict:
    """>>> verify("4 0 7", "407"), verify("<answer>470</answer>", "407"), verify("no idea", "407")
    (<Verdict.CORRECT: 'correct'>, <Verdict.WRONG: 'wrong'>, <Verdict.UNPARSABLE: 'unparsable'>)"""
    digits = "".join(re.findall(r"\d", response))
    if not digits:
        return Verdict.UNPARSABLE
    return Verdict.CORRECT if digits == answer else Verdict.WRONG
