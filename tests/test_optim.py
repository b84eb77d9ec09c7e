"""How a batch becomes optimizer steps (near-equal mini-batches), the learning-rate schedule, and the per-step count
of optimizer steps in the run record: the rules in bapo_vl/optim.py and the embedded backend that follows them."""
import math

import pytest
import torch

from bapo_vl.backends.base import UpdateBatch
from bapo_vl.train import make_backend
from bapo_vl.optim import lr_factor, mini_batches
from bapo_vl.plugins import get_task
from bapo_vl.reader import read_run
from bapo_vl.train import train
from test_backend_contract import G, make_cfg
from test_verl import model_dir  # noqa: F401 (a fixture)


@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 31, 33, 64, 65, 100])
@pytest.mark.parametrize("size", [1, 4, 16])
def test_mini_batches_are_near_equal_and_cover_the_batch(n, size):
    # Could fail if a tail mini-batch were left (17 groups at 16 -> 16 + 1), a group dropped or repeated.
    parts = mini_batches(list(range(n)), size)
    sizes = [len(p) for p in parts]
    assert len(parts) == math.ceil(n / size)
    assert max(sizes) - min(sizes) <= 1 and max(sizes) <= size
    assert [x for p in parts for x in p] == list(range(n))


def test_mini_batches_of_nothing_and_a_bad_size():
    assert mini_batches([], 16) == []
    with pytest.raises(ValueError, match="max_size"):
        mini_batches([1, 2], 0)


def test_lr_schedules():
    # warm-up: step t of W at t / W; then constant, linear to min at the last step, cosine through the midpoint
    assert [lr_factor(t, 10, "constant", warmup=4) for t in (1, 2, 4, 5, 10)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    assert lr_factor(1, 10, "linear") == pytest.approx(0.9)
    assert lr_factor(10, 10, "linear", min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(5, 10, "linear", warmup=0) == pytest.approx(0.5)
    assert lr_factor(5, 10, "cosine") == pytest.approx(0.5)  # halfway: cos(pi / 2) = 0
    assert lr_factor(2, 10, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    assert lr_factor(10, 10, "cosine", min_ratio=0.2) == pytest.approx(0.2)
    assert lr_factor(12, 10, "linear") == 0.0  # past the last step: held at the end
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_factor(1, 10, "step")


def _batch(backend, n_groups: int, step: int) -> UpdateBatch:
    problems = get_task("countdown").load(split="train", template="compact")[:n_groups]
    prompts = [backend.encode(p) for p in problems]
    responses = backend.generate(prompts, G)
    rewards = tuple(tuple(float(j % 2) for j in range(G)) for _ in problems)
    advantages = tuple(tuple(1.0 if w else -1.0 for w in ws) for ws in rewards)
    return UpdateBatch(tuple(prompts), tuple(tuple(g) for g in responses), rewards, advantages, step=step)


def test_embedded_update_takes_near_equal_optimizer_steps_at_the_scheduled_lr(model_dir, tmp_path):
    # Could fail if the embedded backend chunked 5 groups at 4 as 4 + 1 (the tail step) or ignored the schedule:
    # with 5 groups and mini_batch_size 4 it must take 2 optimizer steps of 3 and 2 groups (G sequences each).
    cfg = make_cfg(model_dir, tmp_path, mini_batch_size=4, kl_coef=0.0, lr_schedule="linear", lr_warmup_steps=2,
                   steps=6)
    backend = make_backend(cfg)
    sequences, at_step = [], []  # sequences backpropagated so far; (that count, lr) at each optimizer step
    backward = backend._backward
    backend._backward = lambda micro, *a, **kw: (sequences.append(len(micro)), backward(micro, *a, **kw))[1]
    backend.optimizer.register_step_pre_hook(lambda opt, *_: at_step.append((sum(sequences), opt.param_groups[0]["lr"])))
    metrics = backend.update(_batch(backend, 5, step=1)).metrics
    assert metrics["optimizer_steps"] == 2 and metrics["skipped_steps"] == 0
    per_step = [at_step[0][0], at_step[1][0] - at_step[0][0]]
    assert sorted(per_step) == [2 * G, 3 * G]
    assert metrics["lr"] == pytest.approx(cfg.optim.lr * 0.5) and all(lr == metrics["lr"] for _, lr in at_step)
    metrics = backend.update(_batch(backend, 8, step=4)).metrics  # after warm-up: linear decay, (4 - 2) / (6 - 2) of the way
    assert metrics["optimizer_steps"] == 2 and metrics["lr"] == pytest.approx(cfg.optim.lr * 0.5)


def test_the_record_counts_optimizer_steps_and_the_lr_per_step(model_dir, tmp_path):
    # Could fail if optimizer_steps or lr did not reach the record, or a step that trained nothing had no count.
    cfg = make_cfg(model_dir, tmp_path, batch_size=6, mini_batch_size=4, epochs=2, lr_schedule="cosine",
                   lr_warmup_steps=1, steps=3, kl_coef=0.0)
    steps = read_run(train(cfg, quiet=True))["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        n = s["trained_groups"]
        assert s["optimizer_steps"] == (cfg.optim.epochs * math.ceil(n / cfg.optim.mini_batch_size) if n else 0), s
        assert s["lr"] == pytest.approx(cfg.optim.lr * lr_factor(s["step"], 3, "cosine", warmup=1))
    assert any(s["optimizer_steps"] == 4 for s in steps)  # 6 groups at 4: 2 mini-batches x 2 epochs
    assert torch.isfinite(torch.tensor([s["loss"] for s in steps])).all()
