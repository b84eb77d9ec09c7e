"""fp32 weights for the optimizer, a bf16 copy for the compute: mixed precision as FSDP's MixedPrecision does it, on
one device.

Under autocast an fp32 model casts every weight to bf16 in every micro-batch's forward, keeps its residual stream
and norms in fp32 and casts activations back and forth around each matmul. `ComputeCopy` instead keeps a bf16
copy of the model that runs forward and backward in bf16 throughout; after each micro-batch's backward its
gradients are added into the fp32 model's `.grad` (accumulation stays fp32), the optimizer steps the fp32 weights,
and `refresh()` copies them into the bf16 copy once per optimizer step.

Buffers (the rotary frequencies) stay fp32 in every copy made here, as FSDP's `buffer_dtype` and vLLM keep them: a
frequency f rounded to bf16 moves position p's angle by up to p * f / 256 radians, so a copy with bf16 buffers
computes a different function of the same weights.
"""
from __future__ import annotations

import copy

import torch


# the layers whose weights autocast casts to the compute dtype in every forward (its lower-precision op list)
AUTOCAST_CAST = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with every floating parameter in `dtype` and its buffers as they were (in place)."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return model


def autocast_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen copy of `model` that computes under autocast(dtype) exactly as `model` does, in about half the
    memory: the weights autocast casts to `dtype` in every forward (those of linear and convolution layers) stored
    in `dtype`, everything it computes in fp32 (embeddings, so the residual stream; norms; buffers) kept fp32. A
    weight tied to an embedding (a tied LM head) stays fp32: autocast casts it for the head's product all the same."""
    copied = copy.deepcopy(model).eval().requires_grad_(False)
    kept = {id(p) for m in copied.modules() if not isinstance(m, AUTOCAST_CAST) for p in m.parameters(recurse=False)}
    for m in copied.modules():
        if isinstance(m, AUTOCAST_CAST):
            for p in m.parameters(recurse=False):
                if p.is_floating_point() and id(p) not in kept:
                    p.data = p.data.to(dtype)
    return copied


class ComputeCopy:
    def __init__(self, master: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.master = master
        self.model = cast_parameters(copy.deepcopy(master), dtype)
        self.pairs = [(m, c) for m, c in zip(master.parameters(), self.model.parameters()) if m.requires_grad]

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Add the copy's gradients into the fp32 model's and clear them (after each micro-batch's backward). The
        parameters go through torch's multi-tensor (foreach) ops in a few calls, not one kernel launch per tensor
        from Python."""
        first, more = [], []  # (fp32 .grad, bf16 .grad) pairs
        for m, c in self.pairs:
            if c.grad is None:
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
                first.append((m.grad, c.grad))
            else:
                more.append((m.grad, c.grad))
            c.grad = None
        if first:  # the optimizer step's first micro-batch: its gradients, cast to fp32
            torch._foreach_copy_([m for m, _ in first], [c for _, c in first])
        if more:
            torch._foreach_add_([m for m, _ in more], [c for _, c in more])

    @torch.no_grad()
    def refresh(self) -> None:
        """The copy's weights <- the fp32 weights (after each optimizer step, and after loading weights); buffers
        (rotary frequencies) do not train and stay as the copy was made."""
        torch._foreach_copy_([c for _, c in self.pairs], [m for m, _ in self.pairs])
