"""torch's CUDA out-of-memory error, said as what ran out of memory and which settings lower its need.

torch's message gives the allocation that failed and the card's figures, but not which of a step's phases (sampling,
scoring, the update) made it or what to change; the backends wrap each phase's device work in `named(...)` (verl's
workers' errors reach the driver as Ray's RayTaskError, an instance of the worker's exception class), and `bapo
train` reports the result in one line, with the run marked failed and resumable."""
from __future__ import annotations

from contextlib import contextmanager

import torch


class OutOfGpuMemory(RuntimeError):
    """A phase of a step ran out of GPU memory; the message names its batch and the settings that lower it."""


def card_memory() -> str:
    """'; X GB of the card's Y GB in use' (every process's, as the error leaves it) where this process uses CUDA, ''
    elsewhere (a CPU run, or verl's driver, whose workers hold the GPUs: asking would give the driver a CUDA context of
    its own). Not torch's allocation count, which keeps counting a sleeping vLLM engine's pool."""
    if not torch.cuda.is_initialized():
        return ""
    free, total = torch.cuda.mem_get_info()
    return f"; {(total - free) / 1e9:.1f} GB of the card's {total / 1e9:.1f} GB in use"


@contextmanager
def named(what: str, lower: str):
    """Re-raise torch.OutOfMemoryError inside as OutOfGpuMemory('WHAT ran out of GPU memory (...): LOWER')."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise OutOfGpuMemory(f"{what} ran out of GPU memory{card_memory()}: {lower}") from e


class PhaseMemory(dict):
    """GB (1e9 bytes) of the card's memory in use at the peak of each phase of a step, "generate" and "train"
    (base.Backend.memory; the trainer clears it once a step): in use when the phase starts, by every process (the
    card's total less its free memory: a colocated vLLM engine's pool and torch's cached blocks included), plus how far
    torch's reserved memory rose above its level then, since torch takes device memory only by growing its reserve.
    torch's allocation count would not do: it keeps counting a sleeping vLLM engine's pool, which then holds no memory.
    Another process's growth within the phase is not seen. Empty where the device is not a GPU."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device if device.type == "cuda" else None

    @contextmanager
    def phase(self, name: str):
        if self.device is None:
            yield
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        in_use, reserved = total - free, torch.cuda.memory_reserved(self.device)
        yield
        peak = in_use + torch.cuda.max_memory_reserved(self.device) - reserved
        self[name] = max(self.get(name, 0.0), peak / 1e9)
