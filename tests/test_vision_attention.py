"""segment_sdpa against transformers' own per-segment loop, on a tiny Qwen2.5-VL with real images."""
import json
from collections import Counter

import pytest
import torch
from PIL import Image

from bapo_vl.tiny import build_qwen2_5_vl
from bapo_vl.vision_attention import NAME, segment_sdpa, use_segment_attention


def _model():
    model, processor = build_qwen2_5_vl(seed=0, vision=dict(depth=4, fullatt_block_indexes=[1]),
                                        max_pixels=400 * 400)
    torch.manual_seed(1)
    for p in model.parameters():  # away from the init, so every block's attention matters
        p.data.normal_(0, 0.05)
    return model.train(), processor


def _grads(model, inputs):
    model.zero_grad()
    logits = model(**inputs).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("sizes", [[(224, 224)] * 3,  # one size, whole windows: the single-call path
                                   [(300, 180), (200, 250), (390, 390)]])  # partial windows: grouped by length
def test_same_outputs_and_gradients_as_the_per_segment_loop(sizes):
    # Could fail if segments were mixed up (a gather or reshape in the wrong order), if a window attended across
    # another's boundary, or if the gradient differed from transformers' own path.
    model, processor = _model()
    colours = ["white", "black", "gray"]
    images = [Image.new("RGB", s, c) for s, c in zip(sizes, colours)]
    for im in images:  # content that differs across an image, so attention weights are not uniform
        im.paste((200, 30, 30), (10, 10, 120, 90))
    inputs = processor(text=["<|vision_start|><|image_pad|><|vision_end|>hi"] * 3, images=images,
                       return_tensors="pt", padding=True)
    ref_logits, ref_grads = _grads(model, inputs)
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert use_segment_attention(model)
    assert model.config.vision_config._attn_implementation == NAME
    assert model.config.text_config._attn_implementation == "sdpa"  # the language model keeps its own
    logits, grads = _grads(model, inputs)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=1e-4)
    assert ref_grads.keys() == grads.keys()
    for name in ref_grads:
        assert torch.allclose(grads[name], ref_grads[name], atol=1e-6, rtol=1e-4), name
    assert use_segment_attention(model)  # twice: still selected, nothing else changes


def test_a_saved_model_does_not_carry_the_name(tmp_path):
    # Could fail if the implementation name were written into config.json: vLLM, verl or another process loading
    # the policy would meet a name they do not know.
    model, processor = _model()
    use_segment_attention(model)
    model.save_pretrained(tmp_path)
    assert NAME not in (tmp_path / "config.json").read_text()
    assert "attn_implementation" not in json.loads((tmp_path / "config.json").read_text()).get("vision_config", {})


def test_text_models_are_left_alone():
    from bapo_vl.tiny import build_qwen2

    model, _ = build_qwen2()
    assert not use_segment_attention(model)


def test_refuses_what_it_is_not_for():
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match="vision towers"):
        segment_sdpa(None, q, q, q, cu_seq_lens_q=None)
    with pytest.raises(ValueError, match="vision towers"):
        segment_sdpa(None, q, q, q, cu_seq_lens_q=torch.tensor([0, 6]), is_causal=True)


def test_segments_are_read_from_the_device_once_per_cu_seqlens_tensor():
    # Could fail if each block read the segment lengths again (a host sync per block and step on a GPU), or if a
    # tensor changed in place, or a new one with other segments, kept the grouping of the old one.
    from bapo_vl.vision_attention import segment_groups

    cu = torch.tensor([0, 4, 10, 14, 20])
    groups = segment_groups(cu)
    assert segment_groups(cu) is groups
    assert groups.sizes == [(4, 2), (6, 2)]
    assert groups.order.tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 4, 5, 6, 7, 8, 9, 14, 15, 16, 17, 18, 19]
    assert groups.order[groups.back].tolist() == list(range(20))
    cu[1:] = torch.tensor([5, 10, 15, 20])  # in place: now four segments of 5
    assert segment_groups(cu) == ([(5, 4)], None, None)
    other = torch.tensor([0, 4, 10, 14, 20])
    assert segment_groups(other) is not groups and segment_groups(other).sizes == [(4, 2), (6, 2)]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 8) for _ in range(3))
    for bounds in ([0, 4, 10, 14, 20], [0, 5, 10, 15, 20]):
        cu = torch.tensor(bounds)
        out, _ = segment_sdpa(None, q, k, v, cu_seq_lens_q=cu)
        for a, b in zip(bounds, bounds[1:]):  # each segment attends within itself only
            ref = torch.nn.functional.scaled_dot_product_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :])
            assert torch.allclose(out[0, a:b], ref[0].transpose(0, 1), atol=1e-6)


def test_the_backward_gathers_as_often_whatever_the_number_of_lengths():
    # Could fail if each length's segments were gathered or sliced on their own (three per length and block): each
    # adds its own full-size scatter or zero-fill and copy to the backward.
    def nodes(bounds):
        q, k, v = (torch.randn(1, 2, bounds[-1], 8, requires_grad=True) for _ in range(3))
        out, _ = segment_sdpa(None, q, k, v, cu_seq_lens_q=torch.tensor(bounds))
        seen, todo = [], [out.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is not None and fn not in seen:
                seen.append(fn)
                todo += [f for f, _ in fn.next_functions]
        return Counter(name for name in (type(fn).__name__ for fn in seen) if "Index" in name or "Slice" in name
                       or "Split" in name)

    two, five = nodes([0, 4, 10, 14, 20]), nodes([0, 2, 5, 9, 14, 20, 22])
    assert two == five == {"IndexSelectBackward0": 4, "SplitWithSizesBackward0": 3}  # q, k, v in, the output back
    assert nodes([0, 5, 10, 15, 20]) == {}  # one length: neither


def test_a_forward_waits_for_the_device_as_often_whatever_the_towers_depth(monkeypatch):
    # Could fail if the segment attention read the segment lengths back from the device in each block (a .tolist()
    # or a nonzero per block and length): on a GPU each read stalls the host until the queue has run, so a 32-block
    # tower waited 88 times a forward. What stays is per forward (one read per cu_seqlens tensor and transformers'
    # own), so towers of 2 and 6 blocks wait as often.
    from test_update_efficiency import HostWaits

    images = [Image.new("RGB", s, "white") for s in [(300, 180), (200, 250), (390, 390)]]  # partial windows

    def waits(depth):
        model, processor = build_qwen2_5_vl(seed=0, vision=dict(depth=depth, fullatt_block_indexes=[1]),
                                            max_pixels=400 * 400)
        assert use_segment_attention(model)
        inputs = processor(text=["<|vision_start|><|image_pad|><|vision_end|>hi"] * 3, images=images,
                           return_tensors="pt", padding=True)
        counting = HostWaits()
        tolist = torch.Tensor.tolist
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: counting.calls.update(["tolist"]) or tolist(t))
        with counting, torch.no_grad():
            model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        monkeypatch.undo()
        return counting.calls

    shallow, deep = waits(2), waits(6)
    assert deep == shallow and deep["tolist"] >= 2  # the full-attention and the windows' cu_seqlens, once each


def test_compiled_blocks_do_not_recompile_as_images_change_size():
    # Geometry3K's diagrams come in many sizes, so a run meets new segment lengths every step. Could fail if a
    # compiled block traced into the segment grouping: its graph would guard on the lengths (and on how many
    # distinct ones there are) and compile again for each new layout, until torch.compile's recompile limit sends
    # the rest of the block back to eager.
    from torch._dynamo.utils import counters

    from bapo_vl.backends.embedded import compile_blocks

    torch._dynamo.reset()
    counters.clear()
    model, processor = _model()
    use_segment_attention(model)
    compile_blocks(model)
    sizes = [(224, 224), (300, 180), (200, 250), (390, 390), (260, 330), (120, 370)]
    graphs = []
    with torch.no_grad():
        for i, size in enumerate(sizes):
            image = Image.new("RGB", size, "white")
            image.paste((200, 30, 30), (10, 10, 100, 90))
            inputs = processor(text=["<|vision_start|><|image_pad|><|vision_end|>hi"], images=[image],
                               return_tensors="pt")
            model(**inputs)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0
    assert graphs[-1] == graphs[2], graphs  # after the first sizes (static, then dynamic shapes): no new graph
