"""A freshly built tiny Qwen2.5-VL trains for a few BAPO steps on real Geometry3K diagrams, and on drawn ones each
source's importance ratio is taken against the policy that sampled it (CPU)."""
import random

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from bapo_vl.config import load_config
from bapo_vl.plugins import get_task
from bapo_vl.reader import read_run
from bapo_vl.tiny import build_qwen2_5_vl
from bapo_vl.train import train

MAX_PIXELS = 112 * 112


def prime_to_answer_letters(model, processor, problems, steps=100, seed=0):
    """A few supervised steps so the random model answers `<answer>X</answer>` with a random letter:
    its groups then have mixed rewards, which is what BAPO needs to train on."""
    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        p = rng.choice(problems)
        prompt = processor.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)
        target = f"<answer>{rng.choice('ABCD')}</answer><|im_end|>"
        enc = processor(text=[prompt + target], images=p.images, return_tensors="pt")
        n_prompt = len(processor(text=[prompt], images=p.images, return_tensors="pt")["input_ids"][0])
        labels = enc["input_ids"].clone()
        labels[:, :n_prompt] = -100
        loss = model(**enc, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def test_bapo_trains_tiny_qwen2_5_vl_on_geometry3k(tmp_path, geometry3k_source):
    # Could fail if image prompts broke generation, scoring or the update, if the batch exceeded B, or if final/
    # held other weights than the trained policy's last checkpoint (or did not load and generate from a diagram).
    task = get_task("geometry3k")
    source = geometry3k_source  # ../shared's Geometry3K, else the bundled fixture (3 problems)
    problems = task.load(split="train", source=source, limit=6)
    assert all(p.images and p.images[0].size[0] > 0 for p in problems)
    model, processor = build_qwen2_5_vl(max_pixels=MAX_PIXELS)
    prime_to_answer_letters(model, processor, problems)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    before = {k: v.clone() for k, v in model.state_dict().items()}

    cfg = load_config(overrides=[
        "task=geometry3k", f"task_options={{source: '{source}', limit: 6}}", f"model={tmp_path / 'vl'}",
        f"run_dir={tmp_path / 'runs'}", "name=vl", "steps=4", "batch_size=3", "group_size=4", "delay=2",
        "reeval_every=2", "max_response_length=24", "max_prompt_length=512", f"max_pixels={MAX_PIXELS}",
        "mini_batch_size=2", "micro_batch_size=4", "lr=1e-3", "kl_coef=0.001", "entropy_coef=0.001",
    ])
    run_dir = train(cfg, quiet=True)

    run = read_run(run_dir)
    steps = run["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert sum(s["x1"] + s["x2"] + s["x3"] for s in steps) > 0, "no group was ever trained on"
    assert any(s.get("loss") is not None for s in steps)
    assert all(s["x1"] + s["x2"] + s["x3"] <= 3 for s in steps)

    reloaded = AutoModelForImageTextToText.from_pretrained(run_dir / "final")
    trained = torch.load(run_dir / "checkpoints" / "step_4" / "backend.pt", weights_only=False)["policy"]
    final = reloaded.state_dict()
    assert set(final) <= set(trained) and all(torch.equal(final[k], trained[k]) for k in final)
    changed = [k for k, v in final.items() if not torch.equal(v, before[k])]
    assert changed, "training changed no weight"
    proc = AutoProcessor.from_pretrained(run_dir / "final")
    p = problems[0]
    text = proc.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=[text], images=p.images, return_tensors="pt")
    out = reloaded.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]  # it generated from the diagram prompt



def _primed_geodraw_model(folder):
    task = get_task("geodraw")
    problems = task.load(split="train", limit=24)
    model, processor = build_qwen2_5_vl(max_pixels=MAX_PIXELS)
    prime_to_answer_letters(model, processor, problems)  # about 1 in 4 right: mixed groups, B_bad and B_high fill
    model.save_pretrained(folder)
    processor.save_pretrained(folder)


def _ratio_run(tmp_path, name, lr, *overrides):
    cfg = load_config(overrides=[
        "task=geodraw", "task_options={limit: 24}", f"model={tmp_path / 'vl'}", f"run_dir={tmp_path / 'runs'}",
        f"name={name}", "device=cpu", "dtype=float32", "steps=8", "batch_size=6", "group_size=8", "delay=4",
        "reeval_every=2", "online_filter=uniform", "max_response_length=24", "max_prompt_length=512",
        f"max_pixels={MAX_PIXELS}", "mini_batch_size=6", "micro_batch_size=16", f"lr={lr}", "kl_coef=0",
        "entropy_coef=0", "temperature=0.7", *overrides])
    steps = read_run(train(cfg, quiet=True))["steps"]
    assert all(s["optimizer_steps"] == 1 for s in steps if s["x1"] + s["x2"] + s["x3"])
    for s in steps:  # a source is measured when, and only when, the batch has it
        assert all((f"ratio_max_{k}" in s) == (s[k] > 0) for k in ("x1", "x2", "x3")), s["step"]
    return steps


def test_each_sources_ratio_is_against_the_policy_that_sampled_it(tmp_path):
    # Could fail if any source's stored behaviour log-probs were not those of the policy that sampled it, scored on
    # what the update scores. One optimizer step per update, so the update's forward sees pi_theta as it was when
    # the step began: X2 (re-generated by that policy) and X1 of a step that synced the rollout policy must have
    # every ratio 1 up to float summation order, X1 of the steps between syncs not (the rollout policy lags). With
    # a learning rate of 1e-30 nothing moves, so then every ratio of every source must be 1, X3 too: its groups are
    # replayed from B_high with their prompts encoded again (the diagram drawn and processed anew, its M-RoPE
    # positions computed anew).
    _primed_geodraw_model(tmp_path / "vl")
    one = lambda r: r == pytest.approx(1.0, abs=1e-4)  # noqa: E731
    moving = _ratio_run(tmp_path, "moving", 1e-3)
    assert [s["ratio_max_x2"] for s in moving if s["x2"]] and all(one(s["ratio_max_x2"]) for s in moving if s["x2"])
    synced = [s["ratio_max_x1"] for s in moving if s["x1"] and s["step"] % 4 == 0]
    lagging = [s["ratio_max_x1"] for s in moving if s["x1"] and s["step"] % 4 > 1]
    assert synced and all(one(r) for r in synced), synced
    assert lagging and all(r > 1.01 for r in lagging), lagging
    still = _ratio_run(tmp_path, "still", 1e-30)
    assert {k for s in still for k in ("x1", "x2", "x3") if s[k]} == {"x1", "x2", "x3"}
    assert all(one(s[f"ratio_max_{k}"]) for s in still for k in ("x1", "x2", "x3") if s[k])


@pytest.mark.parametrize("mixed_precision", ["autocast", "compute_copy"])
def test_a_policy_that_does_not_move_has_every_ratio_1_in_bf16(tmp_path, mixed_precision):
    # Could fail if alpha (v > 1) or the behaviour scoring at v = 1 computed otherwise than the update's forward
    # does: a bf16 copy with its rotary frequencies rounded, or the fp32 policy scored where the update computes on
    # the bf16 ComputeCopy. Then pi_theta / alpha is not 1 at the same weights, and the update's clipping acts on
    # rounding instead of on how far the policy moved.
    _primed_geodraw_model(tmp_path / "vl")
    still = _ratio_run(tmp_path, "still", 1e-30, "dtype=bfloat16", f"mixed_precision={mixed_precision}")
    ratios = {k: [s[f"ratio_max_{k}"] for s in still if s[k]] for k in ("x1", "x2", "x3")}
    assert all(ratios.values()), ratios
    assert all(r == pytest.approx(1.0, abs=1e-3) for r in sum(ratios.values(), [])), ratios
