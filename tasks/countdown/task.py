"""Countdown: combine the given numbers with + - * / (each exactly once) to reach the target."""
from __future__ import annotations

import random
from fractions import Fraction

NAME = "countdown"

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
