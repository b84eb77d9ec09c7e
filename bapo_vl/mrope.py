"""Multimodal RoPE positions (Qwen2-VL, Qwen2.5-VL) computed once per prompt, on the CPU.

Without position_ids, transformers computes them inside every forward (get_rope_index): a Python loop over the
batch's rows with small device operations and a host sync each, which for a small model costs as much as the rest
of a training step on a GPU. A row's positions depend only on its own tokens and image grids, and what follows the
prompt (the response) continues it as text, so they are computed per prompt here, by the model class's own
get_rope_index run on CPU tensors (bound to the config, as verl's hf_processor binds it to a processor), and laid
out for a batch by `batch_positions`.
"""
from __future__ import annotations

from types import MethodType, SimpleNamespace

import torch


class PromptPositions:
    """`positions(input_ids, mm_token_type_ids, image_grid_thw)` -> the (3, s) M-RoPE positions of one unpadded
    prompt. Picklable (holds the config only), so data-loader workers can compute them."""

    def __init__(self, config):
        self.config = config
        self._index = None

    @staticmethod
    def supported(config) -> bool:
        """Whether the config's model class has M-RoPE positions (get_rope_index) to compute."""
        from transformers import AutoModel

        model_class = AutoModel._model_mapping.get(type(config), None)
        return model_class is not None and hasattr(model_class, "get_rope_index")

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
