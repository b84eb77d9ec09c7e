"""bapo_vl/workarounds.py: each workaround applies exactly where its condition holds."""
from contextlib import nullcontext

import torch

from bapo_vl.workarounds import NO_CUDNN, cudnn_attention_backward_broken, update_attention


def test_cudnn_attention_is_avoided_only_on_cuda_with_the_affected_torch():
    # Could fail if the workaround applied on every device and torch version (it once did) or on none.
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cudnn_attention_backward_broken(cuda, "2.11.0+cu130") and cudnn_attention_backward_broken(cuda, "2.14.1")
    assert not cudnn_attention_backward_broken(cuda, "2.10.1+cu128")
    assert not cudnn_attention_backward_broken(cpu, "2.14.1")
    assert isinstance(update_attention(cpu), nullcontext)
    assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in NO_CUDNN and len(NO_CUDNN) == 3
