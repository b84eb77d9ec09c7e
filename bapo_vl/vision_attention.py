"""Attention over a vision tower's segments (images, or windows of one) as a few batched SDPA calls.

A Qwen2-VL / Qwen2.5-VL vision tower packs every image of a batch into one sequence and marks where each image (or
each 112 px window of one) starts with `cu_seqlens`. Without flash-attn, transformers attends to the segments one
at a time: one SDPA call per image and layer, one per window in the windowed layers, so a batch of 128 images costs
thousands of small kernels a step. `segment_sdpa` groups the segments by length and runs one SDPA call per length:
a single call when all images have one size (and, for windows, when the grid divides into whole windows).
Same result as the per-segment loop (tests/test_vision_attention.py compares outputs and gradients).
The grouping is read from the device once per `cu_seqlens` tensor: a tower hands the same one (or its windows' one)
to each of its blocks, so a forward waits on the GPU twice rather than once or more in each of its blocks.

`use_segment_attention(model)` registers it with transformers' AttentionInterface (adding a name; nothing of
transformers is replaced) and selects it for the model's vision tower only; the language model keeps its own.
The name holds "flash" because transformers hands `cu_seqlens` only to implementations whose name does.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

NAME = "flash_api_segment_sdpa"


# Outside torch.compile: the grouping is host values (segment lengths, how many distinct ones), which a compiled
# graph would guard on and recompile for as images change size; compiled blocks break here and run it as it is.
@torch.compiler.disable
def segment_sdpa(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                 is_causal=False, **kwargs):
    """query, key, value [1, heads, T, dim], segments cu_seq_lens_q (T = its last entry) -> ([1, T, heads, dim],
    None), as transformers' flash-attention functions return."""
    if cu_seq_lens_q is None or attention_mask is not None or is_causal:
        raise ValueError(f"{NAME} is for vision towers: bidirectional attention within cu_seqlens segments")
    q, k, v = query[0], key[0], value[0]
    heads, total, dim = q.shape
    groups = segment_groups(cu_seq_lens_q)
    if groups[0][1] is None:  # equal segments, contiguous: a reshape, no gather
        size = groups[0][0]
        split = lambda t: t.reshape(heads, -1, size, dim).transpose(0, 1)  # noqa: E731
        out = F.scaled_dot_product_attention(split(q), split(k), split(v), dropout_p=dropout, scale=scaling)
        return out.transpose(1, 2).reshape(1, total, heads, dim), None
    out = q.new_empty(total, heads, dim)
    for size, pos in groups:
        gather = lambda t: t[:, pos].reshape(heads, -1, size, dim).transpose(0, 1)  # noqa: E731
        o = F.scaled_dot_product_attention(gather(q), gather(k), gather(v), dropout_p=dropout, scale=scaling)
        out[pos] = o.transpose(1, 2).reshape(-1, heads, dim)
    return out[None], None


_groups: list[tuple[weakref.ref, int, list]] = []  # (cu_seqlens, its version, its groups): the last few


def segment_groups(cu_seqlens: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
    """The segments of `cu_seqlens` grouped by length: [(length, positions of its tokens on the device, segment by
    segment)], or [(length, None)] when all have one length. Read from the device once per tensor (and again if it
    is changed in place): the tower's blocks share the tensor, so they share the one wait."""
    version = -1 if cu_seqlens.is_inference() else cu_seqlens._version  # inference tensors keep no version
    for ref, seen, groups in _groups:
        if ref() is cu_seqlens and seen == version:
            return groups
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    sizes = sorted(set(lengths))
    if len(sizes) == 1:
        groups = [(sizes[0], None)]
    else:
        starts, groups = cu_seqlens[:-1], []
        for size in sizes:
            which = torch.tensor([i for i, n in enumerate(lengths) if n == size])
            # from pinned memory the copy does not wait for the GPU's queue; from pageable memory it would
            which = which.pin_memory().to(cu_seqlens.device, non_blocking=True) if cu_seqlens.is_cuda else which
            groups.append((size, (starts[which][:, None] + torch.arange(size, device=cu_seqlens.device)).reshape(-1)))
    _groups[:] = [g for g in _groups if g[0]() is not None][-3:] + [(weakref.ref(cu_seqlens), version, groups)]
    return groups


def use_segment_attention(model) -> bool:
    """Select segment_sdpa for `model`'s vision tower when it would otherwise loop over segments (sdpa or eager);
    True if selected. Models without a vision tower, or already on flash attention, are left as they are."""
    from transformers import AttentionInterface

    vision = getattr(model.config, "vision_config", None)
    if vision is None or vision._attn_implementation not in (None, "sdpa", "eager"):
        return vision is not None and vision._attn_implementation == NAME
    AttentionInterface.register(NAME, segment_sdpa)
    model.set_attn_implementation({"vision_config": NAME})
    return True
