"""bapo_vl.backends.mixed_precision.ComputeCopy on a real tiny Qwen2: fp32 accumulation of bf16 gradients, refresh."""
import torch

from bapo_vl.backends.mixed_precision import ComputeCopy
from bapo_vl.tiny import build_qwen2


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
