"""A freshly built tiny Qwen2.5-VL trains for a few BAPO steps on real Geometry3K diagrams (CPU)."""
import random

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
