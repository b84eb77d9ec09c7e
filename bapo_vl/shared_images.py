"""A group's responses share their prompt's images: the vision tower runs once per distinct prompt in a batch.

GRPO scores and trains G responses to each prompt, and a scoring batch or a micro-batch often holds several rows of
one group, so a model forward over the rows would encode the same image up to G times (forward and backward). Here
a batch carries each distinct prompt's pixels once, `image_rows` (for each image token of the batch, in order, its
row in the tower's output) and `image_at` (where those tokens are in the flattened (B * L) batch), both built on the
host.
`last_hidden_state` runs the tower on the distinct images, places their features at every row's image tokens and
runs the language model, as the model's own forward does after its tower (checked against it, gradients included,
in tests/test_update_efficiency.py); it also skips that forward's two reads of the device (the features' split sizes
and the placeholder count check). For the model types of `bapo_vl.mrope`, whose forwards this follows; other
batches go through the model's own forward.
"""
from __future__ import annotations

import numpy as np
import torch

IMAGE_KEYS = ("pixel_values", "image_grid_thw")


def shared_image_inputs(prompts: list[dict], input_ids: torch.Tensor, config) -> dict[str, torch.Tensor]:
    """For a collated batch of `prompts` (one per row, the same dict for rows of one prompt) whose token ids are
    `input_ids` (B, L) on the host: the distinct prompts' pixel_values and image_grid_thw, image_rows and image_at;
    {} when no row has an image."""
    distinct = list({id(p): p for p in prompts if "pixel_values" in p}.values())
    if not distinct:
        return {}
    merge = config.vision_config.spatial_merge_size ** 2
    sizes = [int(p["image_grid_thw"].prod(-1).sum()) // merge for p in distinct]  # feature rows per prompt
    first = dict(zip(map(id, distinct), np.cumsum([0, *sizes[:-1]]).tolist()))
    size = dict(zip(map(id, distinct), sizes))
    is_image = input_ids.numpy() == config.image_token_id
    for row, (p, tokens) in enumerate(zip(prompts, is_image.sum(1).tolist())):
        if tokens != size.get(id(p), 0):
            raise ValueError(f"row {row} of the batch has {tokens} image tokens but its prompt's images give "
                             f"{size.get(id(p), 0)} features")
    rows = np.concatenate([np.arange(first[id(p)], first[id(p)] + size[id(p)]) for p in prompts if "pixel_values" in p])
    at = torch.from_numpy(np.flatnonzero(is_image.ravel()))
    joined = {k: distinct[0][k] if len(distinct) == 1 else torch.cat([p[k] for p in distinct]) for k in IMAGE_KEYS}
    return joined | {"image_rows": torch.from_numpy(rows), "image_at": at}


def last_hidden_state(model, batch: dict) -> torch.Tensor:
    """(B, L, H): the last hidden states of `model` (a ...ForConditionalGeneration or ...ForCausalLM) over `batch`,
    the collated keyword arguments of its forward, with `image_rows` and `image_at` where its images are shared."""
    if "image_at" not in batch:
        return model.model(**batch, use_cache=False).last_hidden_state
    inner = model.model
    batch = dict(batch)
    at, rows = batch.pop("image_at"), batch.pop("image_rows")
    pixels, grid = (batch.pop(k) for k in IMAGE_KEYS)
    vision = {k.removeprefix("image_"): batch.pop(k) for k in list(batch) if k.startswith("image_")}
    batch.pop("mm_token_type_ids", None)  # for positions only, and the batch brings its own
    embeds = inner.get_input_embeddings()(batch.pop("input_ids"))
    features = inner.visual(pixels.type(inner.visual.dtype), grid_thw=grid, **vision).pooler_output
    embeds = embeds.flatten(0, 1).index_copy(0, at, features.index_select(0, rows).to(embeds.dtype)).view_as(embeds)
    return inner.language_model(inputs_embeds=embeds, use_cache=False, **batch).last_hidden_state
