"""Does this card's default attention return NaN query gradients, and does the update's kernel choice
(bapo_vl.workarounds.NO_CUDNN) avoid it? pytorch/pytorch#196678: cuDNN's SDPA backward
(torch 2.11+, H100/H200) when a mask is given, the length is 64 mod 128 and a query row's logsumexp is below
-88.7 (every logit of the row very negative). The case is the issue's own (one head, length 704, a boolean causal
mask, logits about -120).

    python scripts/gpu/attention_nan_check.py          # one JSON line per kernel choice
"""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from bapo_vl.workarounds import NO_CUDNN as UPDATE_ATTENTION


def non_finite_grads(backends, L: int = 704, D: int = 64) -> dict:
    torch.manual_seed(0)
    q = torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16) * 0.1
    k = torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16) * 0.1
    v = torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16)
    q[..., 0], k[..., 0] = 1.0, -120 * D ** 0.5  # every logit about -120
    for t in (q, k, v):
        t.requires_grad_()
    mask = torch.ones(L, L, dtype=torch.bool, device="cuda").tril()[None, None]
    with sdpa_kernel(backends) if backends else torch.enable_grad():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.backward(torch.randn_like(out))
    return {name: int((~torch.isfinite(t.grad)).sum()) for name, t in (("q", q), ("k", k), ("v", v))}


if __name__ == "__main__":
    for name, backends in (("default", None), ("update", UPDATE_ATTENTION)):
        print(json.dumps(dict(card=torch.cuda.get_device_name(0), torch=torch.__version__,
                              cudnn=torch.backends.cudnn.version(), kernels=name,
                              non_finite_grads=non_finite_grads(backends))), flush=True)
