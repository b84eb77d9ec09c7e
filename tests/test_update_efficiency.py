"""The embedded backend's log-probs, entropy, loss and gradients against a plain reference computation (full-sequence
logits -> float64 log_softmax -> gather), for the bundled text policy (float32, and bf16 under both mixed_precision
settings) and a tiny Qwen2.5-VL, and the LM head applied to exactly the response tokens (CPU)."""
import copy
import dataclasses
import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bapo_vl.backends import embedded
from bapo_vl.train import make_backend
from bapo_vl.config import load_config
from bapo_vl.losses import total_loss
from bapo_vl.plugins import get_task
from bapo_vl.tiny import build_qwen2_5_vl

TOL = dict(rtol=1e-4, atol=1e-5)  # fp32: the new path sums in another order (chunks, fewer rows) than the reference
# bf16 compute: the reference's head runs on every position in one product, the backend's on the response rows in
# chunks, so logits differ by bf16 roundings; the gradients also sum the head's chunks in another order
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def reference(backend, prompts, responses):
    """(N, R) log-probs and entropies from the trained model's logits at every position (computed as the backend
    computes them: fp32, or bf16 under autocast or on the ComputeCopy), in float64 from there; 0 on right padding."""
    batch = backend._collate(prompts, responses)
    P = batch.pop("P")
    R = max(len(r) for r in responses)
    if "image_at" in batch:  # the model's own forward, over every row's images (not bapo_vl.shared_images')
        batch = {k: v for k, v in batch.items() if not k.startswith("image_") and k != "pixel_values"}
        batch |= {k: torch.cat([p[k] for p in prompts]) for k in ("pixel_values", "image_grid_thw")}
    with backend._autocast():
        logits = backend.trained(**batch).logits[:, P - 1:P - 1 + R]  # (N, R, V)
    logp_all = torch.log_softmax(logits.double() / backend.sampling.temperature, -1)
    mask = batch["attention_mask"][:, P:].double()
    logp = logp_all.gather(-1, batch["input_ids"][:, P:, None]).squeeze(-1) * mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, entropy, mask


def check(backend, prompts, responses, monkeypatch, tol=TOL, chunk=None):
    policy, trained = backend.policy, backend.trained
    ref_logp, ref_ent, mask = reference(backend, prompts, responses)
    # no grad (score): log-probs, and the LM head applied to the response tokens only, `chunk` rows at a time
    head_rows, chunks, token_logprobs = [], set(), embedded.token_logprobs

    def spy(hidden, head, targets, temperature, rows, *a, **kw):
        head_rows.append(hidden.shape[0])
        chunks.add(rows)
        return token_logprobs(hidden, head, targets, temperature, rows, *a, **kw)

    monkeypatch.setattr(embedded, "token_logprobs", spy)
    scored = backend.score(trained, prompts, responses)
    assert sum(head_rows) == sum(len(r) for r in responses) and chunks == {chunk}
    torch.testing.assert_close(scored, ref_logp.float().detach(), **tol)

    # with grad (_backward): loss and gradients of the fp32 policy (accumulated from the copy's under compute_copy)
    g = torch.Generator().manual_seed(0)
    terms = dict(mask=mask, adv=torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask,
                 old=ref_logp.detach() + 0.05 * torch.randn(mask.shape, generator=g), ref=ref_logp.detach() - 0.1,
                 is_w=None)
    n_tokens = int(mask.sum())
    loss, _ = total_loss(ref_logp, terms["old"], terms["adv"], mask, backend.loss, ref_logp=terms["ref"],
                         entropy=ref_ent if backend.loss.entropy_coef != 0 else ref_ent.detach(), n_tokens=n_tokens,
                         n_seqs=len(prompts))
    trained.zero_grad(set_to_none=True)
    loss.backward()
    want = {k: p.grad.float() for k, p in trained.named_parameters() if p.grad is not None}
    trained.zero_grad(set_to_none=True)
    policy.zero_grad(set_to_none=True)
    idx = list(range(len(prompts)))
    metrics = backend._backward(idx, prompts, responses, {k: v if v is None else v.float() for k, v in terms.items()},
                                n_tokens, len(idx))
    got = {k: p.grad for k, p in policy.named_parameters() if p.grad is not None}
    assert all(isinstance(v, torch.Tensor) for v in metrics.values())  # nothing was moved to the host
    assert float(metrics["loss"]) == pytest.approx(loss.item(), rel=tol["rtol"], abs=tol["atol"])
    assert set(got) == set(want) and all(g.dtype == torch.float32 for g in got.values())
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=tol["rtol"], atol=tol["atol"] * float(want[k].abs().max()),
                                   msg=lambda m: f"{k}: {m}")
    batch = backend._collate(prompts, responses)
    logp, entropy = backend._token_logprobs(trained, batch, [len(r) for r in responses], with_entropy=True)
    assert entropy.requires_grad == (backend.loss.entropy_coef != 0)  # measured only: no graph
    torch.testing.assert_close(logp.detach(), ref_logp.float().detach(), **tol)
    torch.testing.assert_close(entropy.detach(), ref_ent.float().detach(), **tol)


def make(model, tmp_path, **kw):
    values = dict(task="countdown", task_options="{template: compact}", model=model, device="cpu", dtype="float32",
                  max_prompt_length=512, max_response_length=8, kl_coef=0.01, entropy_coef=0.01, temperature=0.7,
                  run_dir=tmp_path, seed=3)
    values.update(kw)
    return make_backend(load_config(overrides=[f"{k}={v}" for k, v in values.items()]))


@pytest.mark.parametrize("settings", [
    dict(dtype="float32"),
    dict(dtype="float32", temperature=1.0, entropy_coef=0.0),  # no division; the entropy only measured
    dict(dtype="bfloat16", mixed_precision="autocast"),
    dict(dtype="bfloat16", mixed_precision="compute_copy", temperature=1.0),
], ids=["fp32", "fp32-T1-entropy-measured", "bf16-autocast", "bf16-compute_copy-T1"])
def test_text_logprobs_entropy_loss_and_grads_match_full_logits(tmp_path, monkeypatch, settings):
    # Could fail if the head saw the prompt/padding rows, if a chunk boundary, the chunked backward or the entropy's
    # gradient changed a log-prob, an entropy or a gradient, if right padding leaked into the loss, or if bf16
    # compute (autocast's casts, the ComputeCopy's gradients) summed the head's gradient wrongly.
    backend = make("countdown-tiny", tmp_path, score_batch_size=2, **settings)  # score() in length-sorted batches
    monkeypatch.setattr(embedded, "LOGIT_FLOATS", 5 * backend.policy.config.vocab_size)  # chunks of 5 rows (13 in all)
    assert (backend.compute is not None) == (settings.get("mixed_precision") == "compute_copy")
    problems = get_task("countdown").load(split="train", template="compact")[:3]
    prompts = [backend.encode(p) for p in problems]
    responses = [[40, 41, 42, 43, 44, 45, 46], [50, 51], [60, 61, 62, 63]]
    check(backend, prompts, responses, monkeypatch, TOL if settings["dtype"] == "float32" else BF16_TOL, chunk=5)


def test_vl_logprobs_entropy_loss_and_grads_match_full_logits(tmp_path, monkeypatch, geometry3k_source):
    model, processor = build_qwen2_5_vl(max_pixels=56 * 56)
    monkeypatch.setattr(embedded, "LOGIT_FLOATS", 4 * model.config.text_config.vocab_size)  # chunks of 4 rows
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    backend = make(tmp_path / "vl", tmp_path, task="geometry3k", task_options="{}", max_pixels=56 * 56)
    problems = get_task("geometry3k").load(split="train", source=geometry3k_source, limit=2)
    prompts = [backend.encode(p) for p in problems]
    assert all("pixel_values" in p for p in prompts)
    # the first prompt's two rows share one pass of the vision tower (bapo_vl.shared_images); the reference does not
    check(backend, [prompts[0], prompts[0], prompts[1]], [[70, 71, 72, 73, 74, 75], [76, 77], [80, 81, 82]],
          monkeypatch, chunk=4)


def test_update_micro_batches_by_length_pad_less_and_change_no_gradient(tmp_path, monkeypatch):
    # Could fail if grouping sequences by length changed the loss or an update (beyond float summation order), or
    # if it saved no padding; balanced_clip, whose bounds are per micro-batch, must keep the group order.
    from bapo_vl import losses
    from bapo_vl.backends.base import Response, UpdateBatch

    problems = get_task("countdown").load(split="train", template="compact")[:4]
    lengths = [[8, 1, 7, 2], [1, 8, 2, 7], [6, 3, 8, 1], [2, 7, 1, 8]]  # every group spans short and long

    def one_update(**kw):
        backend = make("countdown-tiny", tmp_path, micro_batch_size=4, mini_batch_size=4, **kw)
        prompts = [backend.encode(p) for p in problems]
        responses = [[tuple(range(40, 40 + n)) for n in row] for row in lengths]
        flat = [r for rs in responses for r in rs]
        behaviour = backend.score(backend.policy, [p for p in prompts for _ in range(4)], flat)
        groups = tuple(tuple(Response(r, tuple(behaviour[g * 4 + i, :len(r)].tolist())) for i, r in enumerate(rs))
                       for g, rs in enumerate(responses))
        padded, grads = [], []
        collate = backend._collate
        # the accumulated gradient each optimizer step would apply (Adam's first step turns float noise into +-lr)
        monkeypatch.setattr(backend.optimizer, "step", lambda: grads.append(
            {k: p.grad.clone() for k, p in backend.policy.named_parameters() if p.grad is not None}))
        monkeypatch.setattr(backend, "_collate", lambda ps, rs=None: padded.append(
            len(rs) * max(map(len, rs)) - sum(map(len, rs))) or collate(ps, rs) if rs else collate(ps, rs))
        metrics = backend._update(UpdateBatch(prompts=tuple(prompts), responses=groups,
                                              rewards=tuple((1.0, 0.0, 1.0, 0.0) for _ in prompts),
                                              advantages=tuple((1.0, -1.0, 0.5, -0.5) for _ in prompts)))
        return grads, metrics, sum(padded)

    by_length, m_sorted, pad_sorted = one_update()
    monkeypatch.setattr(embedded, "MICRO_BATCH_STATISTICS", {*losses.MICRO_BATCH_STATISTICS, "ppo_clip"})
    in_order, m_order, pad_order = one_update()
    assert pad_sorted < pad_order
    assert m_sorted["loss"] == pytest.approx(m_order["loss"], rel=1e-5, abs=1e-7)
    assert len(by_length) == len(in_order) == 1  # one mini-batch: one optimizer step
    for k, g in in_order[0].items():
        # float summation order: elements near zero differ in their last bits
        torch.testing.assert_close(by_length[0][k], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()))


def test_a_non_finite_gradient_skips_the_optimizer_step_and_keeps_the_weights(tmp_path, caplog):
    # Could fail if a NaN gradient reached AdamW (clipping by a NaN norm makes every weight NaN), if the skip went
    # unreported (metrics, log), or if the next, finite update did not step. On an H200 the 2 B VL shape's second
    # embedded update had a non-finite gradient norm (docs/results.md); here a real NaN comes from a gradient hook.
    from bapo_vl.backends.base import Response, UpdateBatch

    backend = make("countdown-tiny", tmp_path, micro_batch_size=4, mini_batch_size=4)
    problems = get_task("countdown").load(split="train", template="compact")[:2]
    prompts = [backend.encode(p) for p in problems]
    responses = [[(40, 41, 42), (43, 44)], [(45,), (46, 47, 48, 49)]]
    behaviour = backend.score(backend.policy, [p for p in prompts for _ in range(2)], [r for rs in responses for r in rs])
    groups = tuple(tuple(Response(r, tuple(behaviour[g * 2 + i, :len(r)].tolist())) for i, r in enumerate(rs))
                   for g, rs in enumerate(responses))
    batch = UpdateBatch(prompts=tuple(prompts), responses=groups, rewards=((1.0, 0.0), (0.0, 1.0)),
                        advantages=((1.0, -1.0), (-1.0, 1.0)), step=7)
    before = {k: v.clone() for k, v in backend.policy.state_dict().items()}
    name, param = next(iter(backend.policy.named_parameters()))
    hook = param.register_hook(lambda g: g * float("nan"))
    with caplog.at_level("WARNING"):
        metrics = backend.update(batch).metrics
    hook.remove()
    assert metrics["skipped_steps"] == 1 and metrics["grad_norm"] != metrics["grad_norm"]  # NaN
    assert "step 7" in caplog.text and f"{'.'.join(name.split('.')[:2])} 1/" in caplog.text
    after = backend.policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing moved, nothing became NaN

    metrics = backend.update(batch).metrics
    assert metrics["skipped_steps"] == 0 and metrics["grad_norm"] > 0
    after = backend.policy.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert not all(torch.equal(before[k], after[k]) for k in before)


def test_the_update_attends_without_cudnn_where_it_is_broken_and_leaves_the_setting_as_it_was(tmp_path, monkeypatch):
    # Could fail if the update's forward/backward could pick cuDNN's attention where its backward returns NaN query
    # gradients (CUDA, torch >= 2.11: pytorch/pytorch#196678, bapo_vl/workarounds.py), if the workaround applied
    # where it is not needed, or if the setting leaked into the rest of the process. CPU cannot run that kernel;
    # what it shows is the backends each real attention call of an update was allowed, with the condition as it
    # is here (CPU: not broken) and as on an affected GPU (the condition made true).
    import bapo_vl.workarounds
    from bapo_vl.backends.base import Response, UpdateBatch

    backend = make("countdown-tiny", tmp_path, micro_batch_size=2, mini_batch_size=2)
    problems = get_task("countdown").load(split="train", template="compact")[:2]
    prompts = [backend.encode(p) for p in problems]
    responses = [[(40, 41, 42), (43, 44)], [(45,), (46, 47, 48, 49)]]
    groups = tuple(tuple(Response(r, (-1.0,) * len(r)) for r in rs) for rs in responses)
    batch = UpdateBatch(prompts=tuple(prompts), responses=groups, rewards=((1.0, 0.0), (0.0, 1.0)),
                        advantages=((1.0, -1.0), (-1.0, 1.0)))
    sdpa, allowed = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: allowed.append(
        (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
         torch.backends.cuda.mem_efficient_sdp_enabled())) or sdpa(*a, **k))
    backend.generate(prompts, 2)
    assert allowed and all(cudnn for cudnn, *_ in allowed)  # generation keeps the defaults
    allowed.clear()
    assert backend.update(batch).metrics["grad_norm"] > 0
    assert len(allowed) >= 2 * 2 and all(cudnn for cudnn, *_ in allowed)  # on CPU the workaround stays off
    allowed.clear()
    monkeypatch.setattr(bapo_vl.workarounds, "cudnn_attention_backward_broken", lambda device: True)
    assert backend.update(batch).metrics["grad_norm"] > 0
    assert len(allowed) >= 2 * 2 and all(not cudnn and flash and efficient for cudnn, flash, efficient in allowed)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_scoring_runs_in_batches_of_score_batch_size_and_the_update_in_micro_batches(tmp_path, monkeypatch):
    # Could fail if behaviour scoring went back to the update's micro-batches (5.7x slower for the VL shape on an
    # H200, docs/results.md) or the update's gradient accumulation took the scoring size (its activations).
    from bapo_vl.backends.base import Response, UpdateBatch

    backend = make("countdown-tiny", tmp_path, micro_batch_size=1, score_batch_size=3, mini_batch_size=2)
    problems = get_task("countdown").load(split="train", template="compact")[:2]
    prompts = [backend.encode(p) for p in problems]
    responses = [[(40, 41, 42), (43, 44)], [(45,), (46, 47, 48, 49)]]
    sizes, collate = [], backend._collate
    monkeypatch.setattr(backend, "_collate", lambda ps, rs=None: sizes.append(len(ps)) or collate(ps, rs))
    flat = [r for rs in responses for r in rs]
    behaviour = backend.score(backend.rollout, [p for p in prompts for _ in range(2)], flat)
    assert sizes == [3, 1]
    sizes.clear()
    groups = tuple(tuple(Response(r, tuple(behaviour[g * 2 + i, :len(r)].tolist())) for i, r in enumerate(rs))
                   for g, rs in enumerate(responses))
    backend.update(UpdateBatch(prompts=tuple(prompts), responses=groups, rewards=((1.0, 0.0), (0.0, 1.0)),
                               advantages=((1.0, -1.0), (-1.0, 1.0))))
    assert sizes == [3, 1] + [1] * 4  # the reference's scoring (kl_coef > 0), then one micro-batch per sequence


def test_compute_copy_update_gradients_match_fp32_and_the_copy_follows_the_step(tmp_path, monkeypatch):
    # Could fail if the bf16 ComputeCopy dropped or double-counted a micro-batch's gradient, computed the proximal
    # log-probs on other weights than the update's, or kept its old weights after the optimizer step.
    from bapo_vl.backends.base import Response, UpdateBatch

    problems = get_task("countdown").load(split="train", template="compact")[:4]
    lengths = [[8, 1, 7, 2], [1, 8, 2, 7], [6, 3, 8, 1], [2, 7, 1, 8]]

    def update(**kw):
        backend = make("countdown-tiny", tmp_path, micro_batch_size=3, mini_batch_size=4, kl_coef=0.0, **kw)
        prompts = [backend.encode(p) for p in problems]
        responses = [[tuple(range(40, 40 + n)) for n in row] for row in lengths]
        groups = tuple(tuple(Response(r, (-2.0,) * len(r)) for r in rs) for rs in responses)
        grads = []
        step = backend.optimizer.step
        monkeypatch.setattr(backend.optimizer, "step", lambda: grads.append(
            {k: p.grad.clone() for k, p in backend.policy.named_parameters() if p.grad is not None}) or step())
        metrics = backend.update(UpdateBatch(prompts=tuple(prompts), responses=groups,
                                             rewards=tuple((1.0, 0.0, 1.0, 0.0) for _ in prompts),
                                             advantages=tuple((1.0, -1.0, 0.5, -0.5) for _ in prompts))).metrics
        return backend, grads[0], metrics

    _, ref, m_ref = update(dtype="float32")
    backend, got, m_got = update(dtype="bfloat16", mixed_precision="compute_copy")
    assert backend.compute is not None and backend.trained is backend.compute.model
    assert all(p.dtype == torch.float32 for p in backend.policy.parameters())
    flat = lambda g: torch.cat([g[k].flatten() for k in sorted(g)])  # noqa: E731
    assert set(got) == set(ref)
    assert torch.nn.functional.cosine_similarity(flat(got), flat(ref), dim=0) > 0.99
    assert m_got["loss"] == pytest.approx(m_ref["loss"], rel=0.05, abs=1e-3)
    for m, c in zip(backend.policy.parameters(), backend.compute.model.parameters()):
        assert torch.equal(c, m.detach().to(torch.bfloat16))  # refreshed after the step


class HostWaits(TorchDispatchMode):
    """Counts the operations that make the host wait for a GPU to finish its queued work before it can go on: a
    scalar read (.item(), float(), bool(), .tolist()), nonzero and boolean-mask indexing (their result's size depends
    on the data). On CPU nothing waits, but the same operations run: counting them shows where a GPU would."""

    SCALAR_READS = {"_local_scalar_dense", "nonzero", "masked_select"}

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SCALAR_READS:
            self.calls[name] += 1
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.calls["boolean-mask indexing"] += 1
        return func(*args, **(kwargs or {}))


def test_an_update_waits_for_the_device_as_often_whatever_its_micro_batches(tmp_path, monkeypatch):
    # Could fail if a micro-batch read a metric, a count or a mask back from the device (per-micro-batch .item() /
    # .tolist() / nonzero / boolean-mask indexing): on a GPU each such read stalls the host until every queued kernel
    # has run, and the GPU then idles until the host has queued the next ones. What stays is per update and per
    # optimizer step (the gradient norm, the optimizer's own step counters on CPU, the metrics' one transfer), so
    # one micro-batch and four take the same number. The model's own forward (transformers' mask checks) is not ours
    # and is left out of the count.
    from bapo_vl.backends.base import Response, UpdateBatch

    problems = get_task("countdown").load(split="train", template="compact")[:2]

    def waits(micro_batch_size):
        backend = make("countdown-tiny", tmp_path, micro_batch_size=micro_batch_size, mini_batch_size=2)
        prompts = [backend.encode(p) for p in problems]
        responses = [[(40, 41, 42), (43, 44)], [(45,), (46, 47, 48, 49)]]
        groups = tuple(tuple(Response(r, (-1.5,) * len(r)) for r in rs) for rs in responses)
        batch = UpdateBatch(prompts=tuple(prompts), responses=groups, rewards=((1.0, 0.0), (0.0, 1.0)),
                            advantages=((1.0, -1.0), (-1.0, 1.0)), step=1)
        counting = HostWaits()
        tolist = torch.Tensor.tolist
        monkeypatch.setattr(torch.Tensor, "tolist",
                            lambda t: counting.calls.update(["tolist"]) or tolist(t))  # not dispatched on CPU
        decoder = backend.trained.model
        forward = decoder.forward

        def uncounted(*a, **k):  # transformers' forward, outside the count
            with torch.utils._python_dispatch._pop_mode_temporarily():
                return forward(*a, **k)

        monkeypatch.setattr(decoder, "forward", uncounted)
        with counting:
            metrics = backend.update(batch).metrics
        monkeypatch.undo()
        assert metrics["optimizer_steps"] == 1
        return counting.calls

    one, four = waits(4), waits(1)
    assert not one["nonzero"] and not one["boolean-mask indexing"] and not one["masked_select"]
    assert one["tolist"] == 1  # the update's metrics, once
    assert four == one


@pytest.mark.parametrize("settings", [dict(dtype="float32"), dict(dtype="bfloat16", mixed_precision="compute_copy")],
                         ids=["fp32", "bf16-compute_copy"])
def test_compiled_blocks_give_the_eager_logprobs_and_gradients_and_sampling_stays_eager(tmp_path, settings):
    # Could fail if compile=true compiled nothing (no block found, or every call fell back to eager), if the compiled
    # blocks changed a log-prob or a gradient beyond float summation order (bf16: its roundings), if the compute
    # copy's compiled blocks did not pass their gradients to the fp32 weights, or if sampling with the transformers
    # engine ran (and recompiled) the blocks compiled for the update.
    from torch._dynamo.utils import counters

    tol = TOL if settings["dtype"] == "float32" else BF16_TOL
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = (make("countdown-tiny", tmp_path / f"c{c}", compile=c, **settings) for c in (False, True))
    assert (compiled.compute is not None) == ("mixed_precision" in settings)
    layers = compiled.policy.config.num_hidden_layers
    assert sum(getattr(m, "_compiled_call_impl", None) is not None for m in compiled.trained.modules()) == layers
    assert not any(getattr(m, "_compiled_call_impl", None) is not None for m in eager.trained.modules())
    problems = get_task("countdown").load(split="train", template="compact")[:3]
    prompts = [eager.encode(p) for p in problems]
    responses = [[40, 41, 42, 43, 44, 45, 46], [50, 51], [60, 61, 62, 63]]
    scored = eager.score(eager.trained, prompts, responses)
    compiled_scores = compiled.score(compiled.trained, prompts, responses)
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks ran compiled
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (7 - len(r)) for r in responses])
    fp32 = make("countdown-tiny", tmp_path / "fp32", dtype="float32") if settings["dtype"] != "float32" else None
    if fp32 is None:
        torch.testing.assert_close(compiled_scores, scored, **tol)
    else:  # as the gradients below: each bf16 path against the fp32 log-probs, the compiled one no farther than
        # eager bf16's own rounding allows (eager bf16 can be the one farther off: its every op rounds)
        exact = fp32.score(fp32.trained, prompts, responses)
        off = lambda x: float(((x - exact).abs() * mask).max())  # noqa: E731
        assert off(compiled_scores) <= 2 * off(scored) + tol["atol"], (off(compiled_scores), off(scored))

    g = torch.Generator().manual_seed(0)  # old and reference log-probs near the policy's, as in a real update
    terms = dict(mask=mask, adv=torch.randn(mask.shape, generator=g) * mask,
                 old=(scored + 0.05 * torch.randn(mask.shape, generator=g)) * mask, ref=(scored - 0.1) * mask,
                 is_w=None)
    backends = [eager, compiled] + ([fp32] if fp32 is not None else [])  # fp32: what the bf16 updates are held to
    grads, losses = [], []
    for backend in backends:
        backend.policy.zero_grad(set_to_none=True)
        metrics = backend._backward([0, 1, 2], prompts, responses, terms, int(mask.sum()), 3)
        losses.append(float(metrics["loss"]))
        grads.append({k: p.grad for k, p in backend.policy.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1]) and all(g.dtype == torch.float32 for g in grads[1].values())
    if settings["dtype"] == "float32":
        assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-6)
        for k, want in grads[0].items():
            torch.testing.assert_close(grads[1][k], want, rtol=1e-4, atol=1e-5 * float(want.abs().max()), msg=k)
    else:  # bf16 rounds differently where inductor keeps an intermediate in fp32: compiling may move the update
        # away from the fp32 one by about as much as eager bf16 does, not more. Measured on the whole gradient: one
        # small tensor's (a bias summed over 13 tokens) relative error is rounding noise that varies with the CPU's
        # vector width; a gradient that did not arrive is off by 1.0 whatever its size.
        flat = [torch.cat([g[k].flatten() for k in grads[2]]) for g in grads]

        def error(i, k=None):
            got, want = (flat[i], flat[2]) if k is None else (grads[i][k], grads[2][k])
            return float((got - want).norm() / want.norm())

        assert abs(losses[1] - losses[2]) <= 2 * abs(losses[0] - losses[2]) + 0.01
        assert error(1) <= 2 * error(0) + 0.01, (error(1), error(0))
        for k in grads[0]:
            assert error(1, k) < 0.25, (k, error(1, k), error(0, k))

    graphs = counters["stats"]["unique_graphs"]
    assert compiled.rollout is not compiled.policy  # alpha, a copy made before compiling, samples: eager anyway
    sampled = compiled.engine.sample(prompts, 2, "current", False)  # pi_theta samples (X2) with its compiled blocks
    assert len(sampled) == 6 and counters["stats"]["unique_graphs"] == graphs  # ... run eager


def test_compiled_vl_blocks_give_the_eager_logprobs(tmp_path, geometry3k_source):
    # Could fail if the vision blocks or the VL decoder layers did not compile (none found, or a shape the dynamic
    # graph cannot take: images of different sizes), or if compiling them changed a log-prob.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, processor = build_qwen2_5_vl(max_pixels=56 * 56)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    eager, compiled = (make(tmp_path / "vl", tmp_path / f"c{c}", task="geometry3k", task_options="{}",
                            max_pixels=56 * 56, compile=c) for c in (False, True))
    blocks = model.config.text_config.num_hidden_layers + model.config.vision_config.depth
    assert sum(getattr(m, "_compiled_call_impl", None) is not None for m in compiled.trained.modules()) == blocks
    problems = get_task("geometry3k").load(split="train", source=geometry3k_source, limit=2)
    prompts = [eager.encode(p) for p in problems]
    responses = [[70, 71, 72, 73, 74, 75], [80, 81, 82]]
    torch.testing.assert_close(compiled.score(compiled.trained, prompts, responses),
                               eager.score(eager.trained, prompts, responses), **TOL)
    assert counters["stats"]["unique_graphs"] >= 2  # a vision block and a decoder layer


def _saved_bytes(backend, prompts, responses) -> tuple[int, torch.Tensor]:
    """Bytes autograd saves for the backward of one forward of the update (outside checkpointed blocks' inputs),
    and the log-probs it computed."""
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        batch = backend._collate(prompts, responses)
        logp, _ = backend._token_logprobs(backend.trained, batch, [len(r) for r in responses], with_entropy=True)
    return saved, logp


@pytest.mark.parametrize("vl", [False, True], ids=["text", "vl"])
@pytest.mark.parametrize("settings", [dict(dtype="float32"), dict(dtype="bfloat16", mixed_precision="compute_copy")],
                         ids=["fp32", "bf16-compute_copy"])
def test_gradient_checkpointing_keeps_less_and_gives_the_same_update(tmp_path, settings, vl, geometry3k_source):
    # Could fail if no block were checkpointed (a model without _no_split_modules, or the wrapper not reached:
    # autograd would save as much as without), if recomputing a block changed a log-prob, the loss or a gradient
    # (the compute copy's included), or if scoring and sampling (no gradients, a KV cache) went through the
    # checkpoint and broke, or if a deep copy of the model (the critic's body) ran the original's blocks.
    if vl:
        model, processor = build_qwen2_5_vl(max_pixels=56 * 56)
        model.save_pretrained(tmp_path / "vl")
        processor.save_pretrained(tmp_path / "vl")
        kw = dict(model=tmp_path / "vl", task="geometry3k", task_options="{}", max_pixels=56 * 56)
        problems = get_task("geometry3k").load(split="train", source=geometry3k_source, limit=3)
        blocks = model.config.text_config.num_hidden_layers + model.config.vision_config.depth
    else:
        kw = dict(model="countdown-tiny")
        problems = get_task("countdown").load(split="train", template="compact")[:3]
    model_path = kw.pop("model")
    plain, ckpt = (make(model_path, tmp_path / f"g{g}", gradient_checkpointing=g, **kw, **settings)
                   for g in (False, True))
    if not vl:
        blocks = plain.policy.config.num_hidden_layers
    assert sum("forward" in vars(m) for m in ckpt.trained.modules()) == blocks  # each block's forward wrapped
    assert not any("forward" in vars(m) for m in plain.trained.modules())
    prompts = [plain.encode(p) for p in problems]
    responses = [[40, 41, 42, 43, 44, 45, 46], [50, 51], [60, 61, 62, 63]]
    (kept, logp), (kept_ckpt, logp_ckpt) = (_saved_bytes(b, prompts, responses) for b in (plain, ckpt))
    assert kept_ckpt < kept / 4, (kept_ckpt, kept)
    torch.testing.assert_close(logp_ckpt, logp, rtol=0, atol=0)
    torch.testing.assert_close(ckpt.score(ckpt.trained, prompts, responses),
                               plain.score(plain.trained, prompts, responses), rtol=0, atol=0)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (7 - len(r)) for r in responses])
    g = torch.Generator().manual_seed(0)
    terms = dict(mask=mask, adv=torch.randn(mask.shape, generator=g) * mask,
                 old=(logp.detach() + 0.05 * torch.randn(mask.shape, generator=g)) * mask,
                 ref=(logp.detach() - 0.1) * mask, is_w=None)
    grads, losses = [], []
    for backend in (plain, ckpt):
        backend.policy.zero_grad(set_to_none=True)
        metrics = backend._backward([0, 1, 2], prompts, responses, terms, int(mask.sum()), 3)
        losses.append(float(metrics["loss"]))
        grads.append({k: p.grad for k, p in backend.policy.named_parameters() if p.grad is not None})
    assert losses[1] == losses[0] and set(grads[1]) == set(grads[0])
    for k, want in grads[0].items():
        torch.testing.assert_close(grads[1][k], want, rtol=1e-5, atol=1e-7 * float(want.abs().max()), msg=k)
    assert len(ckpt.engine.sample(prompts, 2, "current", False)) == 6  # sampling with a KV cache runs as it was
    twins = [copy.deepcopy(b.trained) for b in (plain, ckpt)]  # as the critic copies its body: its blocks must
    with torch.no_grad():  # run the copy's own weights
        for twin in twins:
            for p in twin.parameters():
                p.mul_(1.1)
    ids = torch.tensor([[40, 41, 42, 43]])
    want, got = (twin(input_ids=ids).logits for twin in twins)  # with gradients: through the checkpoints
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_largest_ratio_of_each_source_is_the_one_its_rows_had(tmp_path):
    # Could fail if the largest ratio by source mixed up rows and sources (rows are regrouped by length for the
    # micro-batches), averaged where it should take the largest, or measured something other than
    # pi_theta / behaviour. Behaviour log-probs are the policy's own, lowered by a known amount on one token of each
    # source's group; one mini-batch, so the ratio is measured before the policy moves: exactly exp(that amount).
    from bapo_vl.backends.base import Response, UpdateBatch

    backend = make("countdown-tiny", tmp_path, micro_batch_size=2, mini_batch_size=8)
    problems = get_task("countdown").load(split="train", template="compact")[:3]
    prompts = [backend.encode(p) for p in problems]
    responses = [[(40, 41, 42), (43, 44)], [(45,), (46, 47, 48, 49)], [(50, 51), (52, 53, 54, 55, 56)]]
    flat = [r for rs in responses for r in rs]
    behaviour = backend.score(backend.policy, [p for p in prompts for _ in range(2)], flat)
    lowered = {(0, 1, 0): 1.0, (1, 1, 3): 0.0, (2, 0, 1): 3.0, (2, 1, 4): 2.0}  # (group, response, token): nats
    groups = tuple(tuple(Response(r, tuple(v - lowered.get((g, i, t), 0.0)
                                           for t, v in enumerate(behaviour[g * 2 + i, :len(r)].tolist())))
                         for i, r in enumerate(rs)) for g, rs in enumerate(responses))
    batch = UpdateBatch(prompts=tuple(prompts), responses=groups, rewards=((1.0, 0.0), (0.0, 1.0), (1.0, 0.0)),
                        advantages=((1.0, -1.0), (-1.0, 1.0), (1.0, -1.0)), step=1, sources=("x1", "x2", "x3"))
    metrics = backend.update(batch).metrics
    assert metrics["ratio_max_x1"] == pytest.approx(math.exp(1.0), rel=1e-4)
    assert metrics["ratio_max_x2"] == pytest.approx(1.0, rel=1e-4)
    assert metrics["ratio_max_x3"] == pytest.approx(math.exp(3.0), rel=1e-4)
    assert metrics["ratio_max"] == pytest.approx(math.exp(3.0), rel=1e-4)
    unnamed = dataclasses.replace(batch, sources=None)  # a batch that does not say its sources: no metrics by source
    assert not any(k.startswith("ratio_max_") for k in backend.update(unnamed).metrics)


def test_pack_and_right_pad_lay_rows_out_as_one_row_at_a_time_would():
    """The update's host-side layout, built from all rows at once (one numpy read), against the plain per-row
    assignment: ragged and empty responses, tuples, lists and tensors, a min_response wider than every row, float and
    integer values. Could fail if a value landed in another row or column, or padding were overwritten."""
    from bapo_vl.backends.base import pack, right_pad

    def one_at_a_time(prompts, responses, pad_id, min_response):
        P, R = max(len(p) for p in prompts), max([min_response, *(len(r) for r in responses)])
        ids, mask = torch.full((len(prompts), P + R), pad_id), torch.zeros(len(prompts), P + R, dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids[i, P - len(p):P], mask[i, P - len(p):P] = torch.as_tensor(p), 1
            for j, t in enumerate(r):
                ids[i, P + j], mask[i, P + j] = t, 1
        return ids, mask, P, R

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50, (n,), generator=gen) for n in (4, 1, 7, 2)]
    responses = [tuple(range(10, 15)), [], [7, 8], torch.tensor([9, 9, 9])]
    for min_response in (0, 9):
        packed = pack(prompts, responses, pad_id=1, min_response=min_response)
        ids, mask, P, R = one_at_a_time(prompts, responses, 1, min_response)
        assert (packed.P, packed.R) == (P, R)
        assert torch.equal(packed.input_ids, ids) and torch.equal(packed.attention_mask, mask)
        assert torch.equal(packed.response_mask, mask[:, P:])
    values = [(-0.5, -1.25, -2.0), (), [-3.5], torch.tensor([-0.125, -4.0])]
    for dtype, fill in ((torch.float32, 0.0), (torch.float64, -1.0), (torch.long, 7)):
        expected = torch.full((4, 5), fill, dtype=dtype)
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                expected[i, j] = float(v) if dtype.is_floating_point else int(v)
        assert torch.equal(right_pad(values, 5, fill, dtype), expected)
    with pytest.raises(ValueError, match="a row of 3 values is wider than 2 columns"):  # refused, not cut
        right_pad([(1.0, 2.0, 3.0)], 2)


def test_response_positions_point_at_each_response_token_and_its_predicting_state():
    """The flat indices the update gathers with, against a walk over the laid-out batch: the state before each
    response token (hidden row-major over B x L) holds the column left of it, whose next id is that token, and each
    token's place in the (B, R) right-padded layout. Ragged, empty and single-token responses; int64 indices."""
    from bapo_vl.backends.base import pack

    prompts = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    responses = [[20, 21], [], [22, 23, 24, 25], [26]]
    packed = pack(prompts, responses, pad_id=0)
    P, L = packed.P, packed.input_ids.shape[1]
    R = max(len(r) for r in responses)
    states_at, tokens_at = embedded.response_positions([len(r) for r in responses], P, L)
    assert states_at.dtype == tokens_at.dtype == torch.long
    expected_states = [b * L + P + j - 1 for b, r in enumerate(responses) for j in range(len(r))]
    expected_tokens = [b * R + j for b, r in enumerate(responses) for j in range(len(r))]
    assert states_at.tolist() == expected_states and tokens_at.tolist() == expected_tokens
    flat = packed.input_ids.flatten()
    assert flat[states_at + 1].tolist() == [t for r in responses for t in r]  # each state's target is its token
    assert [x.tolist() for x in embedded.response_positions([], P, L)] == [[], []]


def test_a_groups_rows_share_one_pass_of_the_vision_tower_and_train_as_if_each_had_its_own(tmp_path,
                                                                                            geometry3k_source):
    """Rows of one prompt (the same dict, as a group's responses are) run the vision tower once per batch: the tower
    sees the distinct prompts' patches only, yet the last hidden states and every parameter's gradient (the tower's
    included) equal the model's own forward over every row's images, in float64. Could fail if a row got another
    prompt's features, if features landed off its image tokens, or if the shared features' gradient were not the sum
    over the rows that use them."""
    from bapo_vl.shared_images import last_hidden_state

    model, processor = build_qwen2_5_vl(max_pixels=56 * 56)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    backend = make(tmp_path / "vl", tmp_path, task="geometry3k", task_options="{}", max_pixels=56 * 56)
    policy = backend.policy.double()
    a, b = (backend.encode(p) for p in get_task("geometry3k").load(split="train", source=geometry3k_source, limit=2))
    assert not torch.equal(a["pixel_values"], b["pixel_values"])
    prompts = [a, a, b, a]  # a group's rows side by side, another prompt between
    responses = [[70, 71, 72, 73, 74, 75], [80, 81, 82], [90, 91, 92, 93], [60]]
    shared = backend._collate(prompts, responses)
    assert len(shared["pixel_values"]) == len(a["pixel_values"]) + len(b["pixel_values"])  # each prompt's once

    every_row = {k: shared[k] for k in ("input_ids", "attention_mask", "position_ids")}
    every_row |= {"pixel_values": torch.cat([p["pixel_values"] for p in prompts]),
                  "image_grid_thw": torch.cat([p["image_grid_thw"] for p in prompts])}
    seen = []
    hook = policy.model.visual.register_forward_pre_hook(lambda mod, args: seen.append(len(args[0])))
    weights = torch.randn(*shared["input_ids"].shape, policy.config.text_config.hidden_size, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(0))
    results = []
    for batch in (shared, every_row):
        policy.zero_grad(set_to_none=True)
        hidden = last_hidden_state(policy, batch)
        (hidden * weights * shared["attention_mask"][..., None]).sum().backward()
        results.append((hidden.detach(), {k: p.grad.clone() for k, p in policy.named_parameters()
                                          if p.grad is not None}))
    hook.remove()
    assert seen == [len(shared["pixel_values"]), len(every_row["pixel_values"])]  # once per prompt, then per row
    (hidden, grads), (want_hidden, want_grads) = results
    mask = shared["attention_mask"].bool()
    torch.testing.assert_close(hidden[mask], want_hidden[mask], rtol=1e-10, atol=1e-12)
    assert set(grads) == set(want_grads) and any(".visual." in f".{k}" for k in grads)
    for k in want_grads:  # the tower's rotary embedding runs in float32 (transformers casts q and k), so summing
        # the rows' gradients before or after the tower differs there by float32 rounding, not float64's
        tol = dict(rtol=1e-5, atol=1e-6 * float(want_grads[k].abs().max())) if ".visual." in f".{k}" else \
            dict(rtol=1e-10, atol=1e-12 * float(want_grads[k].abs().max()))
        torch.testing.assert_close(grads[k], want_grads[k], **tol, msg=lambda m: f"{k}: {m}")


def test_a_row_whose_image_tokens_do_not_match_its_images_is_named(tmp_path, geometry3k_source):
    """A prompt whose ids lost an image token (or whose pixels belong to another image) is refused with the row it is
    in, before any forward: its features would otherwise land on other rows' tokens."""
    model, processor = build_qwen2_5_vl(max_pixels=56 * 56)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    backend = make(tmp_path / "vl", tmp_path, task="geometry3k", task_options="{}", max_pixels=56 * 56)
    a, b = (backend.encode(p) for p in get_task("geometry3k").load(split="train", source=geometry3k_source, limit=2))
    image = backend.policy.config.image_token_id
    cut = dict(b, input_ids=b["input_ids"][b["input_ids"] != image][:-1].clone())  # no image tokens left
    cut["input_ids"] = torch.cat([cut["input_ids"], torch.tensor([image])])  # one
    cut["positions"] = b["positions"][:, :len(cut["input_ids"])]
    with pytest.raises(ValueError, match=r"row 2 of the batch has 1 image tokens but its prompt's images give \d+"):
        backend._collate([a, a, cut], [[70], [71], [72]])


def test_shared_images_follow_qwen2_vls_own_forward_too():
    """Qwen2-VL (the other model type bapo_vl.mrope serves; a tower without windows): rows [a, a, b] with the tower
    run once per prompt give the hidden states of the model's own forward over every row's images, exactly."""
    from PIL import Image
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from bapo_vl.backends.base import pack
    from bapo_vl.mrope import PromptPositions, VisionInputs, batch_positions
    from bapo_vl.shared_images import last_hidden_state, shared_image_inputs

    reference, processor = build_qwen2_5_vl(max_pixels=56 * 56)
    ids = {k: getattr(reference.config, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                     "vision_end_token_id")}
    hidden = reference.config.text_config.hidden_size
    config = Qwen2VLConfig(text_config=reference.config.text_config.to_dict(), **ids,
                           vision_config=dict(depth=2, embed_dim=32, hidden_size=hidden, num_heads=2, mlp_ratio=2,
                                              patch_size=14, spatial_merge_size=2))
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).double().eval()
    encoded = []
    for colour in ((200, 10, 10), (10, 200, 10)):
        out = processor(text=["<|vision_start|><|image_pad|><|vision_end|>how long is AB?"],
                        images=[Image.new("RGB", (56, 56), colour)], return_tensors="pt")
        e = dict(input_ids=out["input_ids"][0], pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        e["positions"] = PromptPositions(config)(e["input_ids"], out["mm_token_type_ids"][0], e["image_grid_thw"])
        encoded.append(e)
    prompts = [encoded[0], encoded[0], encoded[1]]
    packed = pack([p["input_ids"] for p in prompts], [[5, 6, 7], [8, 9], [10]], 0)
    batch = dict(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                 position_ids=batch_positions([p["positions"] for p in prompts],
                                              [packed.P - len(p["input_ids"]) for p in prompts], packed.attention_mask))
    shared = batch | shared_image_inputs(prompts, packed.input_ids, config)
    shared |= VisionInputs(config.vision_config)(shared["image_grid_thw"])
    assert len(shared["pixel_values"]) == 2 * len(encoded[0]["pixel_values"])
    own = batch | {k: torch.cat([p[k] for p in prompts]) for k in ("pixel_values", "image_grid_thw")}
    with torch.no_grad():
        got, want = last_hidden_state(model, shared), model.model(**own, use_cache=False).last_hidden_state
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=0)
