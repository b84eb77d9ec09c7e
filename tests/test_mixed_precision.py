"""bapo_vl.backends.mixed_precision on real tiny Qwen2 / Qwen2.5-VL models: the ComputeCopy's fp32 accumulation of
bf16 gradients and refresh; the frozen copy that computes under autocast as the fp32 model does."""
import copy

import torch

from bapo_vl.backends.mixed_precision import ComputeCopy, autocast_copy
from bapo_vl.tiny import build_qwen2, build_qwen2_5_vl


def _loss(model, ids):
    logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def test_gradients_accumulate_in_fp32_and_match_the_fp32_model():
    # Could fail if gradients were dropped or double-counted across micro-batches, accumulated in bf16, or if the
    # copy computed something other than the fp32 model does (the gradient direction would differ).
    torch.manual_seed(0)
    master, _ = build_qwen2(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    master.train()
    micro = [torch.randint(0, 250, (4, 24)) for _ in range(3)]
    for ids in micro:  # the fp32 reference
        _loss(master, ids).backward()
    ref = {n: p.grad.clone() for n, p in master.named_parameters()}
    master.zero_grad(set_to_none=True)

    cc = ComputeCopy(master)
    assert all(p.dtype == torch.bfloat16 for p in cc.model.parameters())
    sums = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in cc.model.named_parameters()}
    for ids in micro:
        _loss(cc.model, ids).backward()
        for n, p in cc.model.named_parameters():
            sums[n] += p.grad.float()
        cc.accumulate_grads()
        assert all(p.grad is None for p in cc.model.parameters())
    for n, p in master.named_parameters():
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, sums[n]), n  # exactly the sum of the micro-batches' bf16 gradients
    flat = lambda g: torch.cat([v.flatten() for v in g.values()])  # noqa: E731
    new, old = flat({n: p.grad for n, p in master.named_parameters()}), flat(ref)
    assert torch.nn.functional.cosine_similarity(new, old, dim=0) > 0.999
    assert (new.norm() / old.norm() - 1).abs() < 0.02


def test_refresh_copies_the_stepped_weights():
    master, _ = build_qwen2(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    cc = ComputeCopy(master)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    _loss(cc.model, torch.randint(0, 250, (2, 10))).backward()
    cc.accumulate_grads()
    before = [p.detach().clone() for p in cc.model.parameters()]
    opt.step()
    cc.refresh()
    for m, c, b in zip(master.parameters(), cc.model.parameters(), before):
        assert torch.equal(c, m.detach().to(torch.bfloat16))
    assert any(not torch.equal(c, b) for c, b in zip(cc.model.parameters(), before))  # the step reached the copy


def _vl_inputs(processor, n_rows=2):
    from PIL import Image

    image = Image.new("RGB", (112, 112), (200, 30, 90))
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>" + "x" * 150 + "<|im_end|>\n"
    return processor(text=[prompt] * n_rows, images=[image] * n_rows, return_tensors="pt")


def test_autocast_copy_computes_as_the_model_does_under_autocast():
    # Could fail if the frozen copy rounded what autocast keeps fp32 (rotary frequencies, norms, the embeddings and
    # so the residual stream, a tied head) or kept fp32 what autocast casts: its log-probs would then differ from
    # pi_theta's at the same weights, and BAPO's ratio pi_theta / alpha would not be 1 right after a sync.
    model, processor = build_qwen2_5_vl(max_pixels=112 * 112)
    enc = _vl_inputs(processor)
    frozen = autocast_copy(model, torch.bfloat16)
    rounded = copy.deepcopy(model).to(torch.bfloat16)  # the whole model cast, buffers too
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(**enc).logits.float()
        got = frozen(**enc).logits.float()
        other = rounded(**enc).logits.float()
    assert torch.equal(got, want)
    assert not torch.equal(other, want)  # a different function of the same weights
    floating = [b for b in frozen.buffers() if b.is_floating_point()]
    assert floating and all(b.dtype == torch.float32 for b in floating)
    embedding = frozen.get_input_embeddings().weight
    linear = [m.weight for m in frozen.modules() if isinstance(m, torch.nn.Linear) and m.weight is not embedding]
    assert linear and all(w.dtype == torch.bfloat16 for w in linear)
    assert embedding.dtype == torch.float32 and frozen.lm_head.weight is embedding  # tied, and kept fp32
    assert not any(p.requires_grad for p in frozen.parameters())


def test_compute_copy_keeps_the_rotary_frequencies_in_fp32():
    # Could fail if the bf16 compute copy rounded its rotary frequencies (position p's angle off by up to p f / 256).
    master, _ = build_qwen2(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    cc = ComputeCopy(master)
    freqs = {n: b for n, b in cc.model.named_buffers() if "inv_freq" in n}
    assert freqs and all(b.dtype == torch.float32 for b in freqs.values())
    assert all(torch.equal(b, dict(master.named_buffers())[n]) for n, b in freqs.items())
