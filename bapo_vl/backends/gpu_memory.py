"""torch's CUDA out-of-memory error, said as what ran out of memory and which settings lower its need.

torch's message gives the allocation that failed and the card's figures, but not which of a step's phases (sampling,
scoring, the update) made it or what to change; the embedded backend wraps each phase's device loop in
`named(...)`, and `bapo train` reports the result in one line, with the run marked failed and resumable."""
from __future__ import annotations

from contextlib import contextmanager

import torch


class OutOfGpuMemory(RuntimeError):
    """A phase of a step ran out of GPU memory; the message names its batch and the settings that lower it."""


def card_memory() -> str:
    """'; peak X GB allocated by this process, card Y GB' on CUDA, '' elsewhere."""
    if not torch.cuda.is_available():
        return ""
    _, total = torch.cuda.mem_get_info()
    return f"; peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB allocated by this process, card {total / 1e9:.1f} GB"


@contextmanager
def named(what: str, lower: str):
    """Re-raise torch.OutOfMemoryError inside as OutOfGpuMemory('WHAT ran out of GPU memory (...): LOWER')."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise OutOfGpuMemory(f"{what} ran out of GPU memory{card_memory()}: {lower}") from e
