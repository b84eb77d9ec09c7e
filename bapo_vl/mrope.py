"""Multimodal RoPE positions (Qwen2-VL, Qwen2.5-VL) computed once per prompt, on the CPU; and the vision tower's
index tensors, computed once per list of image sizes.

Without position_ids, transformers computes them inside every forward (get_rope_index): a Python loop over the
batch's rows with small device operations and a host sync each, which for a small model costs as much as the rest
of a training step on a GPU. A row's positions depend only on its own tokens and image grids, and what follows the
prompt (the response) continues it as text, so they are computed per prompt here, by the model class's own
get_rope_index run on CPU tensors (bound to the config, as verl's hf_processor binds it to a processor), and laid
out for a batch by `batch_positions`.

The vision tower likewise recomputes, in every forward, its rotary positions, image boundaries and window order with
a loop over the images. `VisionInputs` computes them with transformers' own helpers (transformers.vision_utils) on
the CPU, once per list of image grids, and hands them to the forward as the precomputed `image_*` keyword arguments
transformers accepts for this (`accepts_precomputed_kwargs`).
"""
from __future__ import annotations

from collections import OrderedDict
from types import MethodType, SimpleNamespace

import torch

# the model types whose forwards these inputs were checked against (tests/test_mrope.py); others compute their own
MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def supported(config) -> bool:
    """Whether PromptPositions and VisionInputs serve this model's config."""
    return getattr(config, "model_type", None) in MODEL_TYPES


class PromptPositions:
    """`positions(input_ids, mm_token_type_ids, image_grid_thw)` -> the (3, s) M-RoPE positions of one unpadded
    prompt. Picklable (holds the config only), so data-loader workers can compute them."""

    def __init__(self, config):
        self.config = config
        self._index = None

    def _bind(self):
        from transformers import AutoModel

        model_class = AutoModel._model_mapping[type(self.config)]
        holder = SimpleNamespace(config=self.config)
        if hasattr(model_class, "get_vision_position_ids"):
            holder.get_vision_position_ids = MethodType(model_class.get_vision_position_ids, holder)
        return MethodType(model_class.get_rope_index, holder)

    def __getstate__(self):
        return {"config": self.config, "_index": None}

    def __call__(self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor,
                 image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        if self._index is None:
            self._index = self._bind()
        positions, _ = self._index(input_ids.cpu()[None], mm_token_type_ids=mm_token_type_ids.cpu()[None],
                                   image_grid_thw=None if image_grid_thw is None else image_grid_thw.cpu())
        return positions[:, 0]


def batch_positions(prompt_positions: list[torch.Tensor], starts: list[int] | torch.Tensor,
                    attention_mask: torch.Tensor) -> torch.Tensor:
    """(3, B, L) positions of a batch whose row i holds its prompt from column starts[i] on (left padding before it,
    its response after it, padding after that): the prompt's own positions, then text positions continuing from its
    largest, zero where attention_mask is 0 -- what get_rope_index computes for the whole batch."""
    B, L = attention_mask.shape
    out = torch.zeros(3, B, L, dtype=torch.long)
    for i, (pos, start) in enumerate(zip(prompt_positions, [int(s) for s in starts])):
        s = pos.shape[1]
        out[:, i, start:start + s] = pos
        after = L - start - s
        if after > 0:
            out[:, i, start + s:] = pos.max() + 1 + torch.arange(after)
    return out * attention_mask.to(out.device, torch.long)[None]


class VisionInputs:
    """`inputs(image_grid_thw)` -> the vision tower's precomputed keyword arguments for a batch of images:
    image_position_ids, image_cu_seqlens and, for a windowed tower (Qwen2.5-VL), image_window_index and
    image_cu_window_seqlens; cached for the `cache` most recent lists of grids (a batch of equal images repeats)."""

    def __init__(self, vision_config, cache: int = 16):
        self.merge = vision_config.spatial_merge_size
        self.window_size = getattr(vision_config, "window_size", None)
        self.patch_size = vision_config.patch_size
        self.cache, self._seen = cache, OrderedDict()

    def __call__(self, image_grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

        key = tuple(map(tuple, image_grid_thw.tolist()))
        if key not in self._seen:
            grid = image_grid_thw.cpu()
            out = {"image_position_ids": get_vision_position_ids(grid, self.merge),
                   "image_cu_seqlens": get_vision_cu_seqlens(grid)}
            if self.window_size:
                index, bounds = get_vision_window_index(grid, spatial_merge_size=self.merge,
                                                        window_size=self.window_size, patch_size=self.patch_size)
                out |= {"image_window_index": index, "image_cu_window_seqlens": bounds}
            self._seen[key] = out
            if len(self._seen) > self.cache:
                self._seen.popitem(last=False)
        self._seen.move_to_end(key)
        return self._seen[key]
