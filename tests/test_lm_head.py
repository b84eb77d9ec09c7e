"""bapo_vl/lm_head.py: token log-probs and entropies through the LM head, chunked, with a hand-written backward,
against autograd over the full logits (float64, and bf16 products as autocast and the ComputeCopy run them)."""
import math

import pytest
import torch

from bapo_vl.lm_head import _TokenLogProbs, token_logprobs

N, H, V = 7, 6, 13  # 7 rows in chunks of 3: two full chunks and a partial one


def setup(dtype=torch.float64, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.8)
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    hidden = (torch.randn(N, H, generator=g) * 1.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    upstream = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    return head, hidden, targets, upstream


def full_reference(hidden, head, targets, temperature, compute=torch.float64):
    """log-probs and entropies from the full (N, V) logits, by autograd: the product in `compute`, the rest in
    float64."""
    bias = None if head.bias is None else head.bias.to(compute)
    logits = torch.nn.functional.linear(hidden.to(compute), head.weight.to(compute), bias)
    log_p = torch.log_softmax(logits.double() / temperature, -1)
    return log_p.gather(1, targets[:, None]).squeeze(1), -(log_p.exp() * log_p).sum(-1)


def grads(hidden, head, loss):
    params = [hidden, head.weight] + ([head.bias] if head.bias is not None else [])
    for p in params:
        p.grad = None
    loss.backward()
    return [p.grad.clone() for p in params]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("entropy_in_loss", [True, False])
def test_float64_values_and_gradients_equal_autograd_over_the_full_logits(temperature, bias, entropy_in_loss):
    # Could fail if a chunk boundary dropped or repeated a row, if the temperature were applied twice or not at all
    # (T = 1 skips the division), or if the hand-written backward of the log-prob, the entropy or the bias were wrong.
    head, hidden, targets, (g, e) = setup(bias=bias)
    want_logp, want_ent = full_reference(hidden, head, targets, temperature)
    logp, ent = token_logprobs(hidden, head, targets, temperature, rows=3, dtype=torch.float64, with_entropy=True)
    torch.testing.assert_close(logp, want_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=1e-12, atol=1e-12)
    use = lambda lp, h: (g * lp).sum() + ((e * h).sum() if entropy_in_loss else 0.0)  # noqa: E731
    want = grads(hidden, head, use(want_logp, want_ent))
    got = grads(hidden, head, use(logp, ent if entropy_in_loss else ent.detach()))
    for w, x in zip(want, got):
        torch.testing.assert_close(x, w, rtol=1e-10, atol=1e-12)


def test_gradcheck_of_the_chunked_backward():
    # Could fail if the backward were not the derivative of the forward (by finite differences), for the log-probs
    # alone (the entropy unused: its gradient comes back as None) and for both.
    head, hidden, targets, _ = setup(bias=True)
    inputs = (hidden.detach().requires_grad_(), head.weight.detach().requires_grad_(),
              head.bias.detach().requires_grad_())
    both = lambda h, w, b: _TokenLogProbs.apply(h, w, b, targets, 0.7, 3, torch.float64, True, False)  # noqa: E731
    assert torch.autograd.gradcheck(both, inputs)
    assert torch.autograd.gradcheck(lambda *a: both(*a)[0], inputs)


@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_bf16_products_match_autograd_in_the_dtypes_of_autocast_and_the_compute_copy(weights):
    # autocast (float32 weights, bf16 products) and the ComputeCopy (bf16 weights). Could fail if the product did
    # not run in the compute dtype (the log-probs would differ from the bf16 logits'), if a gradient came back in
    # another dtype than its tensor's, or if the bf16 path's backward dropped or repeated a chunk.
    head, hidden, targets, (g, e) = setup(dtype=torch.float32, bias=True)
    head = head.to(getattr(torch, weights))
    hidden = hidden.detach().to(getattr(torch, weights)).requires_grad_()
    logp, ent = token_logprobs(hidden, head, targets, 0.7, rows=3, dtype=torch.bfloat16, with_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32
    want_logp, want_ent = full_reference(hidden, head, targets, 0.7, compute=torch.bfloat16)
    torch.testing.assert_close(logp.double(), want_logp, rtol=1e-6, atol=1e-6)  # the same bf16 logits
    torch.testing.assert_close(ent.double(), want_ent, rtol=1e-6, atol=1e-6)
    got = grads(hidden, head, (g * logp).sum() + (e * ent).sum())
    # float64 from the same bf16 logits on: the exact gradient of what was computed, up to the products' bf16
    want = grads(hidden, head, (g * want_logp).sum() + (e * want_ent).sum())
    for x, w, p in zip(got, want, [hidden, head.weight, head.bias]):
        assert x.dtype == p.dtype
        torch.testing.assert_close(x.double(), w.double(), rtol=2e-2, atol=2e-2 * float(w.abs().max()))


def test_without_grad_and_without_entropy():
    head, hidden, targets, _ = setup()
    with torch.no_grad():
        logp, ent = token_logprobs(hidden, head, targets, 1.0, rows=4, dtype=torch.float64)
    assert ent is None and logp.grad_fn is None and logp.shape == (N,)
    torch.testing.assert_close(logp, full_reference(hidden, head, targets, 1.0)[0].detach())
    with pytest.raises(TypeError, match="not a torch.nn.Linear"):
        token_logprobs(hidden, torch.nn.Sequential(head), targets, 1.0, rows=4, dtype=torch.float64)


def test_large_and_equal_logits_stay_finite():
    # equal logits: the uniform distribution (log-prob -log V, entropy log V), however large the logits
    head = torch.nn.Linear(1, 50, bias=False)
    with torch.no_grad():
        head.weight.fill_(1e4)
    hidden = torch.ones(3, 1, requires_grad=True)
    logp, ent = token_logprobs(hidden, head, torch.tensor([0, 7, 49]), 1.0, rows=2, dtype=torch.float32,
                               with_entropy=True)
    torch.testing.assert_close(logp, torch.full((3,), -math.log(50)))
    torch.testing.assert_close(ent, torch.full((3,), math.log(50)))
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(head.weight.grad).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_compiled_chunks_give_the_eager_values_and_gradients_with_one_graph_for_every_row_count(dtype):
    # compile=true runs each chunk's work under torch.compile. Could fail if the compiled functions computed something
    # else than the eager ones (the temperature, the entropy's term of the backward, the bias, the dtypes), or if
    # each chunk's row count compiled its own graph (7 rows in chunks of 4: 4 and 3).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    head, hidden, targets, (g, e) = setup(bias=True)
    head = head.to(dtype)
    hidden = hidden.detach().to(dtype).requires_grad_()
    compute = torch.float64 if dtype == torch.float64 else torch.bfloat16
    for entropy_in_loss in (True, False):
        results = []
        for compiled in (False, True):
            logp, ent = token_logprobs(hidden, head, targets, 0.7, rows=4, dtype=compute, with_entropy=True,
                                       compiled=compiled)
            measured = ent if entropy_in_loss else ent.detach()
            loss = (g.to(logp.dtype) * logp).sum() + (e.to(ent.dtype) * measured).sum()
            results.append([logp, ent, *grads(hidden, head, loss)])
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
        for eager, fused in zip(*results):
            assert fused.dtype == eager.dtype
            torch.testing.assert_close(fused.double(), eager.double(), **tol)
    assert counters["stats"]["unique_graphs"] == 3  # the forward, the backward with and without the entropy's term
