"""How a training batch becomes optimizer steps, and the learning rate of each step: backend-neutral rules.

Mini-batches. A BAPO batch holds a varying number n of groups (X1 + X2 + X3). Cutting it into chunks of
`mini_batch_size` would leave a small tail (17 groups at 16: one step of 16 groups, one of 1 group) whose loss, a
mean, weighs as much as a full step: mostly noise. `mini_batches` splits n groups into ceil(n / mini_batch_size)
mini-batches whose sizes differ by at most one group, so every optimizer step of a training step sees an equal share.

Learning rate. A factor of `lr` per training step t = 1..T (`steps`): a linear warm-up over the first W steps
(t / W), then constant, linear or cosine decay from 1 to `min_lr_ratio` at step T.
"""
from __future__ import annotations

import math
from typing import Sequence, TypeVar

T = TypeVar("T")

LR_SCHEDULES = ("constant", "linear", "cosine")


def mini_batches(items: Sequence[T], max_size: int) -> list[list[T]]:
    """ceil(n / max_size) contiguous slices of `items`, the first n % k one item longer than the rest.
    >>> [len(m) for m in mini_batches(range(17), 16)], [len(m) for m in mini_batches(range(64), 16)]
    ([9, 8], [16, 16, 16, 16])"""
    n = len(items)
    if max_size < 1:
        raise ValueError(f"max_size={max_size} must be >= 1")
    k = math.ceil(n / max_size)
    if k == 0:
        return []
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        size = base + (i < extra)
        out.append(list(items[start:start + size]))
        start += size
    return out


def lr_factor(step: int, steps: int, schedule: str = "constant", warmup: int = 0, min_ratio: float = 0.0) -> float:
    """The learning rate of training step `step` (1..steps) as a fraction of the configured lr.
    >>> [round(lr_factor(t, 10, "linear", warmup=2), 3) for t in (1, 2, 3, 10)]
    [0.5, 1.0, 0.875, 0.0]
    >>> lr_factor(6, 10, "cosine", warmup=2, min_ratio=0.1) == 0.1 + 0.9 * 0.5
    True"""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; have {', '.join(LR_SCHEDULES)}")
    if 0 < warmup and step <= warmup:
        return max(step, 1) / warmup  # step 0: an update outside the training loop (tests, benchmarks)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay
