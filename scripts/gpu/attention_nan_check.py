"""Does this card's default attention return NaN query gradients for a left-padded batch, and does the update's
kernel choice (bapo_vl.backends.embedded.UPDATE_ATTENTION: no cuDNN) avoid it? pytorch/pytorch#196678: cuDNN's
SDPA backward (torch 2.11+, H100/H200) when a mask is given, the length is 64 mod 128 and a query row attends to
nothing. The batch here is the update's case: 2 sequences, the second left-padded, bf16, GQA heads of the VL shape.

    python scripts/gpu/attention_nan_check.py          # one JSON line per (length, kernels)
"""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from bapo_vl.backends.embedded import UPDATE_ATTENTION


def nan_grads(length: int, pad: int, backends) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 12, length, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    keep = torch.ones(2, length, dtype=torch.bool, device="cuda")
    keep[1, :pad] = False  # left padding of the second row
    mask = torch.ones(length, length, dtype=torch.bool, device="cuda").tril() & keep[:, None, None, :]
    # transformers' SDPA mask: a float mask with the dtype's minimum where a key is hidden
    bias = torch.zeros(mask.shape, dtype=torch.bfloat16, device="cuda").masked_fill(~mask, torch.finfo(torch.bfloat16).min)
    with sdpa_kernel(backends) if backends else torch.enable_grad():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        out.backward(torch.randn_like(out) * keep[:, None, :, None])  # no loss on the padding rows
    return {name: int((~torch.isfinite(t.grad)).sum()) for name, t in (("q", q), ("k", k), ("v", v))}


if __name__ == "__main__":
    for length in (640, 704, 768, 832):
        for name, backends in (("default", None), ("update", UPDATE_ATTENTION)):
            print(json.dumps(dict(card=torch.cuda.get_device_name(0), torch=torch.__version__,
                                  cudnn=torch.backends.cudnn.version(), length=length, kernels=name,
                                  non_finite_grads=nan_grads(length, pad=37, backends=backends))), flush=True)
