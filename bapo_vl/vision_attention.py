"""Attention over a vision tower's segments (images, or windows of one) as a few batched SDPA calls.

A Qwen2-VL / Qwen2.5-VL vision tower packs every image of a batch into one sequence and marks where each image (or
each 112 px window of one) starts with `cu_seqlens`. Without flash-attn, transformers attends to the segments one
at a time: one SDPA call per image and layer, one per window in the windowed layers, so a batch of 128 images costs
thousands of small kernels a step. `segment_sdpa` groups the segments by length and runs one SDPA call per length:
a single call when all images have one size (and, for windows, when the grid divides into whole windows). Grouping
is one gather and one split of q, k and v and one gather of the output, however many lengths there are: a gather
or a slice per length and tensor would each add a full-size scatter or zero-fill to the backward.
Same result as the per-segment loop (tests/test_vision_attention.py compares outputs and gradients).
The grouping is read from the device once per `cu_seqlens` tensor: a tower hands the same one (or its windows' one)
to each of its blocks, so a forward waits on the GPU twice rather than once or more in each of its blocks.

`use_segment_attention(model)` registers it with transformers' AttentionInterface (adding a name; nothing of
transformers is replaced) and selects it for the model's vision tower only; the language model keeps its own.
The name holds "flash" because transformers hands `cu_seqlens` only to implementations whose name does.
"""
from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

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
    heads, _, dim = q.shape
    segments = segment_groups(cu_seq_lens_q)
    if segments.order is not None:  # one gather each, whatever the number of lengths (its backward: one index_add)
        q, k, v = (t.index_select(1, segments.order) for t in (q, k, v))
    tokens = [size * count for size, count in segments.sizes]  # one length's segments are contiguous now
    parts = [t.split(tokens, 1) if len(tokens) > 1 else (t,) for t in (q, k, v)]
    outs = []
    for (size, count), *qkv in zip(segments.sizes, *parts):
        qs, ks, vs = [t.reshape(heads, count, size, dim).transpose(0, 1) for t in qkv]
        o = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout, scale=scaling)
        outs.append(o.transpose(1, 2).reshape(size * count, heads, dim))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if segments.order is not None:
        out = out.index_select(0, segments.back)
    return out[None], None


class Segments(NamedTuple):
    """A cu_seqlens' segments grouped by length: `sizes` [(length, how many segments)], and where the groups'
    tokens are: `order` (token positions, group after group) and `back` (each token's place in that order), both on
    the device; None when the segments are already grouped (one length)."""
    sizes: list[tuple[int, int]]
    order: torch.Tensor | None
    back: torch.Tensor | None


_groups: list[tuple[weakref.ref, int, Segments]] = []  # (cu_seqlens, its version, its segments): the last few


def segment_groups(cu_seqlens: torch.Tensor) -> Segments:
    """The segments of `cu_seqlens` grouped by length. Read from the device once per tensor (and again if it is
    changed in place): the tower's blocks share the tensor, so they share the one wait."""
    version = -1 if cu_seqlens.is_inference() else cu_seqlens._version  # inference tensors keep no version
    for ref, seen, segments in _groups:
        if ref() is cu_seqlens and seen == version:
            return segments
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    sizes = sorted(set(lengths))
    if len(sizes) == 1:
        segments = Segments([(sizes[0], len(lengths))], None, None)
    else:
        by_length = sorted(range(len(lengths)), key=lengths.__getitem__)  # stable: in order within a length
        positions = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in by_length])
        back = torch.empty_like(positions)
        back[positions] = torch.arange(len(positions))
        if cu_seqlens.is_cuda:  # copies from pinned memory do not wait for the GPU's queue; from pageable they would
            positions, back = (t.pin_memory().to(cu_seqlens.device, non_blocking=True) for t in (positions, back))
        segments = Segments([(size, lengths.count(size)) for size in sizes], positions, back)
    _groups[:] = [g for g in _groups if g[0]() is not None][-3:] + [(weakref.ref(cu_seqlens), version, segments)]
    return segments


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
