"""bapo_vl.mrope: M-RoPE positions computed once per prompt equal what transformers computes in every forward."""
import pickle

import pytest
import torch

from bapo_vl.config import load_config
from bapo_vl.mrope import PromptPositions, VisionInputs, batch_positions, supported
from bapo_vl.plugins import get_task
from bapo_vl.shared_images import last_hidden_state
from bapo_vl.tiny import build_qwen2_5_vl, build_qwen2

SIDE = 56


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    model, processor = build_qwen2_5_vl(seed=0, min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE)
    folder = tmp_path_factory.mktemp("vl")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model.eval(), processor, folder


def problems(n=4):
    # geodraw's questions differ in length, so the prompts do too
    return list(get_task("geodraw").load(split="test", n=n, seed=0, image_size=SIDE))


def test_batch_positions_equal_get_rope_index_on_the_embedded_layout(tiny_vl):
    from bapo_vl.train import make_backend

    model, _, folder = tiny_vl
    cfg = load_config(overrides=["task=geodraw", f"model={folder}", "device=cpu", "dtype=float32",
                                 f"max_pixels={SIDE * SIDE}", f"min_pixels={SIDE * SIDE}", "max_prompt_length=512"])
    backend = make_backend(cfg)
    prompts = [backend.encode(p) for p in problems()]
    assert len({len(p["input_ids"]) for p in prompts}) > 1, "the test needs prompts of unequal length"
    responses = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
    batch = backend._collate(prompts, responses)
    P = batch.pop("P")
    # the model's own inputs for these rows: every row's images, and image-token markers from the ids
    types = (batch["input_ids"] == model.config.image_token_id).long()
    own = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "mm_token_type_ids": types,
           "pixel_values": torch.cat([p["pixel_values"] for p in prompts]),
           "image_grid_thw": torch.cat([p["image_grid_thw"] for p in prompts])}
    reference, _ = model.model.get_rope_index(own["input_ids"], mm_token_type_ids=types,
                                              image_grid_thw=own["image_grid_thw"],
                                              attention_mask=own["attention_mask"])
    assert torch.equal(batch["position_ids"], reference)
    assert P == max(len(p["input_ids"]) for p in prompts)
    precomputed = {"position_ids", "image_position_ids", "image_cu_seqlens", "image_window_index",
                   "image_cu_window_seqlens"}
    assert precomputed <= set(batch)
    # the forward given the positions and the vision tower's inputs is the forward that computes them
    with torch.no_grad():
        given = last_hidden_state(model, batch)
        computed = model.model(**own).last_hidden_state
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(given[mask], computed[mask], rtol=0, atol=0)
    # generation batches (no responses) leave positions to generate
    assert "position_ids" not in backend._collate(prompts)


def test_a_shifted_prompt_is_caught(tiny_vl):
    """batch_positions places each prompt where it starts: a wrong start gives other positions."""
    model, processor, _ = tiny_vl
    positions = PromptPositions(model.config)
    enc = [processor(text=[processor.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)],
                     images=p.images, return_tensors="pt") for p in problems(2)]
    pos = [positions(e["input_ids"][0], e["mm_token_type_ids"][0], e["image_grid_thw"]) for e in enc]
    L = max(p.shape[1] for p in pos) + 3
    mask = torch.ones(2, L, dtype=torch.long)
    starts = [L - 3 - p.shape[1] for p in pos]
    for i, s in enumerate(starts):
        mask[i, :s] = 0
    good = batch_positions(pos, starts, mask)
    assert (good[:, :, -3:] == torch.stack([p.max() + 1 + torch.arange(3) for p in pos])[None]).all()
    assert not torch.equal(batch_positions(pos, [s + 1 for s in starts], mask), good)


def test_prompt_positions_pickle_for_data_workers(tiny_vl):
    model, processor, _ = tiny_vl
    positions = PromptPositions(model.config)
    p = problems(1)[0]
    e = processor(text=[processor.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)],
                  images=p.images, return_tensors="pt")
    before = positions(e["input_ids"][0], e["mm_token_type_ids"][0], e["image_grid_thw"])
    after = pickle.loads(pickle.dumps(positions))(e["input_ids"][0], e["mm_token_type_ids"][0], e["image_grid_thw"])
    assert torch.equal(before, after) and before.shape == (3, e["input_ids"].shape[1])
    # the image's tokens are laid out on a grid: not all three rows are the text's 0, 1, 2, ...
    assert not torch.equal(before[1], before[2])


def test_text_models_have_no_mrope(tiny_vl):
    out = build_qwen2()
    model = out[0] if isinstance(out, tuple) else out
    assert not supported(model.config) and supported(tiny_vl[0].config)


def test_vision_inputs_are_what_the_tower_computes(tiny_vl):
    # Could fail if an index tensor differed from transformers' (the tower's output would change) or if the cache
    # handed one list of grids the inputs of another.
    model, _, _ = tiny_vl
    vision = VisionInputs(model.config.vision_config, cache=1)
    torch.manual_seed(0)
    for grids in ([[1, 8, 8], [1, 8, 8], [1, 4, 4]], [[1, 4, 8], [1, 8, 8]], [[1, 8, 8], [1, 8, 8], [1, 4, 4]]):
        grid = torch.tensor(grids)
        pixels = torch.randn(int(grid.prod(-1).sum()), 1176)
        with torch.no_grad():
            own = model.model.visual(pixels, grid_thw=grid).pooler_output
            given = model.model.visual(pixels, grid_thw=grid, **{k.removeprefix("image_"): v
                                                                  for k, v in vision(grid).items()}).pooler_output
        torch.testing.assert_close(given, own, rtol=0, atol=0)
