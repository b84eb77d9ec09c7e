"""Workarounds for bugs in the libraries bapo-vl runs on, each applied only where its condition holds and each with
the condition under which it can go.

- The update's attention without cuDNN's kernel: cuDNN's SDPA backward returns NaN query gradients when a mask is
  given, the length is 64 mod 128 and a row's logits are all very negative (pytorch/pytorch#196678; seen with torch
  2.11 on H100 and H200; `scripts/gpu/attention_nan_check.py` shows it on a card). Applies on CUDA with torch >= 2.11;
  remove once that issue is fixed in the torch versions pyproject.toml admits.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _torch_at_least(version: str, minimum: tuple[int, int]) -> bool:
    major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    return (major, minor) >= minimum


def cudnn_attention_backward_broken(device: torch.device, version: str = torch.__version__) -> bool:
    """Whether the update must keep clear of cuDNN's attention (see the module docstring)."""
    return device.type == "cuda" and _torch_at_least(version, (2, 11))


def update_attention(device: torch.device):
    """The context the update's forward and backward run in: every SDPA kernel but cuDNN's where it is broken,
    torch's own choice elsewhere."""
    return sdpa_kernel(NO_CUDNN) if cudnn_attention_backward_broken(device) else nullcontext()
