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
    """'; peak X GB allocated by this process, card Y GB' where this process uses CUDA, '' elsewhere (a CPU run, or
    verl's driver, whose workers hold the GPUs: asking would give the driver a CUDA context of its own)."""
    if not torch.cuda.is_initialized():
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


class PhaseMemory(dict):
    """GB (1e9 bytes) of GPU memory by phase of a step (base.Backend.memory; the trainer clears it once a step):
    "generate" and "train", the most this process's tensors held in the phase (torch's peak, reset as it starts),
    and "card", the most in use on the card at a phase's end by every process: its total less its free memory, so a
    colocated vLLM engine's pool, torch's cached blocks and other programs on the card count. What a card must hold
    for a run is at least the largest of them. Empty where the device is not a GPU."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device if device.type == "cuda" else None

    @contextmanager
    def phase(self, name: str):
        if self.device is None:
            yield
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        free, total = torch.cuda.mem_get_info(self.device)
        self[name] = max(self.get(name, 0.0), torch.cuda.max_memory_allocated(self.device) / 1e9)
        self["card"] = max(self.get("card", 0.0), (total - free) / 1e9)
