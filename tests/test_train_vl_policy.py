"""scripts/train_vl_policy.py: a tiny Qwen2.5-VL trained from scratch on geodraw (CPU), saved as a policy folder the
RL trainer loads, with the prompts encoded exactly as the embedded backend encodes them at RL time."""
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

ROOT = Path(__file__).resolve().parent.parent
SIDE = 112  # a 112 px diagram: 16 image tokens


def _script():
    spec = importlib.util.spec_from_file_location("train_vl_policy", ROOT / "scripts" / "train_vl_policy.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_vl_policy"] = mod
    spec.loader.exec_module(mod)
    return mod


script = _script()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("vlpolicy") / "geodraw-tiny"
    # 8 problems in batches of 8: every step sees the same fixed set, so the loss must fall
    meta = script.main(["--size", "geodraw-tiny", "--out", str(out), "--data", "fixed", "--problems", "8", "--batch", "8",
                        "--steps", "40", "--lr", "3e-3", "--warmup", "5", "--image-size", str(SIDE),
                        "--eval-problems", "8", "--log-every", "1", "--device", "cpu"])
    return out, meta


def test_trains_saves_and_evaluates(trained):
    # Could fail if the loss did not fall on a fixed set (labels off the response, pixels mangled), if the folder
    # did not load as an image-text model + processor, or if the evaluation results were not written.
    out, meta = trained
    losses = [d["loss"] for d in meta["loss_log"]]
    assert meta["steps"] == 40 and len(losses) == 40
    assert losses[-1] < 0.5 * losses[0], losses
    # the step time of every log line (log every step here): positive, and the run's whole time bounds their sum
    step_seconds = [d["step_seconds"] for d in meta["loss_log"]]
    assert all(t > 0 for t in step_seconds) and sum(step_seconds) <= meta["train_seconds"] + 0.06  # train_seconds: 0.1 s rounding
    model = AutoModelForImageTextToText.from_pretrained(out)
    processor = AutoProcessor.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == meta["params"] < 2_000_000
    assert processor.image_processor.size["longest_edge"] == SIDE * SIDE  # max_pixels
    saved = json.loads((out / "training.json").read_text())
    e = saved["eval"]
    assert e["n"] == 8 and 0 <= e["greedy_acc"] <= 1 and 0 <= e["blank_images_greedy_acc"] <= 1
    assert set(e["greedy_acc_by_kind"]) <= {"triangle", "parallel", "circle", "rectangle"}
    assert "blank images" in (out / "TRAINING.md").read_text()
    assert saved["command"].startswith("PYTHONPATH=. python scripts/train_vl_policy.py --size geodraw-tiny")


def test_init_from_trains_a_saved_policy_further(trained, tmp_path):
    # Could fail if --init-from left the weights random (the loss would start where a new model's does), loaded
    # them only in part, or took a policy of another shape without one clear line.
    out, meta = trained
    again = script.main(["--size", "geodraw-tiny", "--out", str(tmp_path / "more"), "--data", "fixed", "--problems", "8",
                         "--batch", "8", "--steps", "1", "--lr", "1e-9", "--warmup", "1", "--image-size", str(SIDE),
                         "--eval-problems", "4", "--log-every", "1", "--device", "cpu", "--init-from", str(out)])
    first, last = meta["loss_log"][0]["loss"], meta["loss_log"][-1]["loss"]
    assert abs(again["loss_log"][0]["loss"] - last) < 0.25 * (first - last), (first, last, again["loss_log"])
    card = (tmp_path / "more" / "TRAINING.md").read_text()
    assert again["init_from"] == str(out) and f"trained further from `{out}`" in card
    assert "trained further (SFT) on the geodraw train split" in card and "from scratch" not in card
    with pytest.raises(SystemExit, match=f"--init-from {out}: not a policy of this shape"):
        script.main(["--size", "geodraw-tiny", "--hidden", "32", "--out", str(tmp_path / "other"), "--data", "fixed",
                     "--problems", "8", "--steps", "1", "--image-size", str(SIDE), "--device", "cpu",
                     "--init-from", str(out)])


def test_stop_after_is_the_first_steps_of_the_planned_schedule(trained, tmp_path):
    # Could fail if --stop-after shortened the learning-rate schedule (the losses would part from the 40-step run's
    # after warm-up), ran a step more or less, or the card did not say where the run stopped.
    out, meta = trained
    cut = script.main(["--size", "geodraw-tiny", "--out", str(tmp_path / "cut"), "--data", "fixed", "--problems", "8",
                       "--batch", "8", "--steps", "40", "--stop-after", "12", "--lr", "3e-3", "--warmup", "5",
                       "--image-size", str(SIDE), "--eval-problems", "4", "--log-every", "1", "--device", "cpu"])
    assert cut["steps"] == 12 and cut["steps_planned"] == 40 and not cut["stopped_by_max_seconds"]
    assert [d["loss"] for d in cut["loss_log"]] == pytest.approx([d["loss"] for d in meta["loss_log"][:12]], rel=1e-5)
    assert "stopped after 12 of 40 planned steps (--stop-after)" in (tmp_path / "cut" / "TRAINING.md").read_text()
    with pytest.raises(SystemExit, match="--stop-after 41: must be in 1..--steps"):
        script.main(["--size", "geodraw-tiny", "--out", str(tmp_path / "x"), "--steps", "40", "--stop-after", "41",
                     "--device", "cpu"])


def test_evaluate_gives_what_the_training_run_measured(trained, tmp_path):
    # Could fail if --evaluate loaded the policy, encoded the prompts or graded the responses otherwise than the end
    # of a training run does (its figures would part from training.json's), or did not write its JSON.
    out, meta = trained
    got = script.main(["--evaluate", str(out), "--eval-problems", "8", "--image-size", str(SIDE), "--device", "cpu",
                       "--out", str(tmp_path / "eval.json")])
    e = meta["eval"]
    assert (got["greedy_acc"], got["numbers_read"], got["blank_images_greedy_acc"]) == (
        e["greedy_acc"], e["numbers_read"], e["blank_images_greedy_acc"])
    assert got["greedy_acc_by_kind"] == e["greedy_acc_by_kind"] and got["examples"] == e["examples"]
    assert json.loads((tmp_path / "eval.json").read_text())["n"] == 8


def test_target_is_graded_correct():
    from bapo_vl.problem import Verdict

    task = script.get_task()
    for p in task.load(split="train", limit=16, image_size=SIDE):
        for target in script.TARGETS:
            assert task.verify(script.target_text(p, target), p.answer) == Verdict.CORRECT
            wrong = next(x for x in "ABCD" if x != p.answer["letter"])
            other = replace(p, answer={**p.answer, "letter": wrong})
            assert task.verify(script.target_text(other, target), p.answer) != Verdict.CORRECT


def test_read_target_copies_the_numbers_drawn():
    # Could fail if the "read" response named numbers that are not the ones written in the image (the triangle's
    # x vertex included, or a circle's derived value instead of the written one).
    task = script.get_task()
    seen = set()
    for p in task.load(split="train", limit=64, image_size=SIDE):
        spec, kind = p.meta["spec"], p.meta["kind"]
        numbers = script.written_numbers(spec, SIDE)
        seen.add(kind)
        if kind == "triangle":
            assert sorted(map(int, numbers)) == sorted(spec["key"][2:]) and len(numbers) == 2
            assert sum(map(int, numbers)) + spec["answer"] == 180
        elif kind == "rectangle":
            assert sorted(numbers) == sorted([str(spec["w"]), str(spec["h"])])
        else:
            assert len(numbers) == 1
        # left to right in the image: the order a reader of the image can know
        xs = [x for t, x, _ in task.module.layout(spec, SIDE)["labels"] if t.rstrip("°").isdigit()]
        assert len(xs) == len(numbers) and [t.rstrip("°") for t, x, _ in sorted(
            task.module.layout(spec, SIDE)["labels"], key=lambda lab: lab[1]) if t.rstrip("°").isdigit()] == numbers
        text = script.target_text(p, "read")
        assert text.startswith(" ".join(numbers) + " -> " + p.answer["value"] + " ")


def test_prompts_are_what_the_embedded_backend_encodes(trained):
    # Could fail if SFT rendered the prompt (chat template, image tokens, pixel values, image-token markers)
    # differently from how the RL backend renders it for the saved policy: SFT and RL would see other tokens.
    from bapo_vl.config import load_config
    from bapo_vl.train import make_backend

    out, _ = trained
    cfg = load_config(overrides=[
        "task=geodraw", f"model={out}", "device=cpu", "dtype=float32", "delay=1", "kl_coef=0.0",
        f"max_pixels={SIDE * SIDE}", "max_prompt_length=512"])
    backend = make_backend(cfg)
    task = script.get_task()
    problems = task.load(split="train", limit=3, image_size=SIDE)
    args = type("A", (), dict(script.SIZES["geodraw-tiny"], image_size=SIDE, seed=0))
    _, processor = script.build(args)  # the processor the script trains with
    enc = script.Encoded(problems, processor)
    for i, p in enumerate(problems):
        ref = backend.encode(p)
        s = int(enc.starts[i])
        assert enc.ids[i, :s].tolist() == ref["input_ids"].tolist()
        assert enc.types[i, :s].tolist() == ref["mm_token_type_ids"].tolist()
        assert torch.equal(enc.grid, ref["image_grid_thw"])
        assert torch.allclose(enc.pixels(torch.tensor([i]), "cpu"), ref["pixel_values"], atol=1e-5)
        # the labels are exactly the response: the numbers read, the value, <answer>X</answer><|im_end|>
        resp = enc.labels[i][enc.labels[i] != -100]
        assert processor.tokenizer.decode(resp) == script.target_text(p) + "<|im_end|>"
        assert (enc.labels[i, :s] == -100).all()


def _fresh_args(workers: int):
    return type("A", (), dict(script.SIZES["geodraw-tiny"], image_size=SIDE, seed=0, data_seed=3, batch=4,
                              target="read", data_workers=workers))


def _take(batches, n):
    return [next(batches) for _ in range(n)]


def test_fresh_data_is_new_every_batch_and_repeats_run_to_run():
    # Could fail if workers drew the same chunk (every example seen once per worker), if a batch repeated, or if
    # the same command gave another order (a run would not reproduce).
    args = _fresh_args(2)
    model, processor = script.build(args)
    positions = script.PromptPositions(model.config)
    first = _take(script.fresh_batches(processor, args, positions), 6)
    again = _take(script.fresh_batches(processor, args, positions), 6)
    for a, b in zip(first, again):
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["pix"], b["pix"])
    rows = {(tuple(ids.tolist()), bytes(pix.flatten().numpy())) for b in first for ids, pix in zip(b["ids"], b["pix"])}
    assert len(rows) == 6 * 4  # 24 distinct problems
    b = first[0]
    resp = b["labels"][0][b["labels"][0] != -100]  # labels are the response, as in the fixed set
    assert processor.tokenizer.decode(resp).endswith("</answer><|im_end|>")
    assert b["pix"].dtype == torch.uint8 and b["grid"].tolist() == [[1, SIDE // 14, SIDE // 14]]
    assert b["positions"].shape == (3, *b["ids"].shape)  # computed in the workers


@pytest.mark.parametrize("side", [SIDE, 224])
def test_fresh_rows_are_the_processors_encoding(side):
    # Could fail if PromptBytes (the data workers' encoding: patches cut from the image's bytes, image tokens spelled
    # out) laid out a patch, a channel or the temporal copy otherwise than the processor does, or tokenized the
    # prompt otherwise: the fresh data would differ from the fixed set's and from what RL feeds the policy.
    args = type("A", (), dict(script.SIZES["geodraw-tiny"], image_size=side, seed=0))
    model, processor = script.build(args)
    positions = script.PromptPositions(model.config)
    problems = script.get_task().load(split="train", n=12, seed=1, image_size=side)
    # and one in colour (the drawn diagrams are grey, R = G = B, which would hide a channel laid out wrong)
    noise = torch.randint(0, 256, (side, side, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    problems.append(replace(problems[0], images=[Image.fromarray(noise.numpy(), "RGB")]))
    fast, slow = script.PromptBytes(processor), None
    for p in problems:
        row = script.encode_row(processor, p, "read", positions, True, fast)
        ref = script.encode_row(processor, p, "read", positions, True)
        slow = slow or script.PixelCodec(processor, ref["pixel_values"].shape[1])
        assert row["pixel_values"].dtype == torch.uint8
        assert torch.equal(row["pixel_values"], slow.to_bytes(ref["pixel_values"]))
        for key in ("ids", "types", "start"):
            assert row[key] == ref[key], key
        for key in ("grid", "positions", "glyphs"):
            assert torch.equal(row[key], ref[key]), key
    assert fast.checked and not fast.fallback  # the rows were PromptBytes' own, not the processor's


@pytest.mark.parametrize("case", ["resized image", "other layout"])
def test_fresh_rows_fall_back_to_the_processor(case, capsys):
    # Could fail if an image the processor resizes (100 px: not a multiple of 28) were cut into patches as it is, or
    # if the first problem were not checked against the processor (here a patch layout other than the processor's):
    # either would train on other data; or if the run stopped instead of going on with the processor's rows.
    side = 100 if case == "resized image" else SIDE
    args = type("A", (), dict(script.SIZES["geodraw-tiny"], image_size=side, seed=0))
    _, processor = script.build(args)
    problems = script.get_task().load(split="train", n=3, seed=1, image_size=side)
    fast = script.PromptBytes(processor)
    if case == "other layout":
        fast.temporal = 1
    for p in problems:
        enc, ref = fast(p), script.encode_prompt(processor, p)
        assert torch.equal(enc["input_ids"], ref["input_ids"])
        assert torch.equal(enc["pixel_bytes"], script.PixelCodec(processor, ref["pixel_values"].shape[1]).to_bytes(
            ref["pixel_values"]))
    said = capsys.readouterr().out.splitlines()
    why = "not a multiple of 28 px" if case == "resized image" else "encodes it otherwise (pixel_bytes)"
    assert len(said) == 1 and said[0].startswith(f"problem {problems[0].uid}: ") and why in said[0], said
    assert fast.fallback


def test_trains_on_fresh_data(tmp_path):
    # Could fail if the fresh batches did not reach the model in its input format (the step would raise).
    meta = script.main(["--size", "geodraw-tiny", "--out", str(tmp_path / "p"), "--batch", "4", "--steps", "3",
                        "--image-size", str(SIDE), "--eval-problems", "4", "--log-every", "1", "--device", "cpu",
                        "--data-workers", "1"])
    assert meta["data"] == "fresh" and meta["problems"] == 12 and meta["steps"] == 3
    assert "each drawn once" in (tmp_path / "p" / "TRAINING.md").read_text()
    # the wait for the data workers is part of each logged step's time; step 1 waits for the worker to start and
    # draw its first batch, so a wait that was not measured (0) fails
    log = meta["loss_log"]
    assert all(0 <= d["data_wait_seconds"] <= d["step_seconds"] for d in log), log
    assert log[0]["data_wait_seconds"] > 0, log


def test_training_batches_carry_the_positions_the_model_would_compute():
    # Could fail if a row's M-RoPE positions (bapo_vl.mrope, computed once per row on the CPU) differed from
    # transformers' get_rope_index over the padded batch, or if the forward given them differed from one without.
    args = type("A", (), dict(script.SIZES["geodraw-tiny"], image_size=SIDE, seed=0))
    model, processor = script.build(args)
    problems = script.get_task().load(split="train", n=5, seed=0, image_size=SIDE)
    enc = script.Encoded(problems, processor, positions=script.PromptPositions(model.config),
                         vision=script.VisionInputs(model.config.vision_config))
    inputs, _, _ = enc.batch(torch.arange(5), "cpu")
    position_ids = inputs.pop("position_ids")
    vision = {k: inputs.pop(k) for k in list(inputs) if k.startswith("image_") and k != "image_grid_thw"}
    assert len(vision) == 4
    reference, _ = model.model.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                              image_grid_thw=inputs["image_grid_thw"],
                                              attention_mask=inputs["attention_mask"])
    assert torch.equal(position_ids, reference)
    with torch.no_grad():
        given = model(**inputs, position_ids=position_ids, **vision).logits
        computed = model(**inputs).logits
    mask = inputs["attention_mask"].bool()
    torch.testing.assert_close(given[mask], computed[mask], rtol=0, atol=0)


def test_glyph_labels_mark_the_patches_where_characters_are_drawn():
    # Could fail if a label pointed at another patch than the one its character is drawn in (the processor's patch
    # order is merge x merge blocks, not rows), or if a drawn character had no label: the glyph loss would teach the
    # vision tower nonsense. Checked against the pixel values the processor makes, not against our own layout.
    from bapo_vl.tiny import build_qwen2_5_vl

    side = 224
    _, processor = build_qwen2_5_vl(seed=0, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64,
                                    max_pixels=side * side)
    task = script.get_task()
    merge = processor.image_processor.merge_size
    for p in task.load(split="train", limit=24, image_size=side):
        enc = script.encode_prompt(processor, p)
        labels = script.glyph_labels(p, enc["image_grid_thw"], merge)
        pv = enc["pixel_values"]  # [patches, 3 * 2 * 14 * 14], normalised: the darkest value is ink
        assert labels.shape == (pv.shape[0],)
        ink = pv.reshape(pv.shape[0], 3, -1).mean(1).amin(-1) < -1.0  # a patch with a black pixel
        marked = labels > 0
        glyphs = task.module.layout(p.meta["spec"], side)["glyphs"]
        places = {(int(y * 16 / side), int(x * 16 / side)) for _, x, y in glyphs}  # 16 x 16 patches
        assert int(marked.sum()) == len(places)  # every patch with a character's ink centre, and no other
        assert (ink[marked]).float().mean() >= 0.9, p.uid  # characters are drawn where they are marked
        digits = [c for c, _, _ in glyphs if c.isdigit()]
        assert sorted(script.GLYPHS[int(k) - 1] for k in labels[marked] if script.GLYPHS[int(k) - 1].isdigit()) \
            == sorted(digits)
        # the same patch, found from its row and column in the image: where the processor put it
        ch, x, y = glyphs[0]
        h, w = int(enc["image_grid_thw"][0, 1]), int(enc["image_grid_thw"][0, 2])
        py, px = int(y * h / side), int(x * w / side)
        patch = p.images[0].convert("L").crop((px * side // w, py * side // h, (px + 1) * side // w,
                                              (py + 1) * side // h))
        index = ((py // merge) * (w // merge) + px // merge) * merge * merge + (py % merge) * merge + px % merge
        assert int(labels[index]) == 1 + script.GLYPHS.index(ch)
        assert min(patch.getdata()) < 128 and bool(ink[index])


def test_glyph_loss_trains_the_probe_on_the_image_tokens(tmp_path):
    # Could fail if the probe never saw the image tokens (hook on the wrong module), if its loss did not reach the
    # optimizer, or if the probe were saved into the policy folder.
    out = tmp_path / "p"
    meta = script.main(["--size", "geodraw-tiny", "--out", str(out), "--data", "fixed", "--problems", "8",
                        "--batch", "8", "--steps", "30", "--lr", "3e-3", "--warmup", "3", "--image-size", str(SIDE),
                        "--eval-problems", "4", "--log-every", "1", "--device", "cpu", "--glyph-loss", "1.0"])
    g = [d["glyph_loss"] for d in meta["loss_log"] if "glyph_loss" in d]
    assert len(g) == 30 and g[-1] < 0.65 * g[0], g
    assert meta["glyph_loss"] == 1.0
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == meta["params"]  # the policy alone
    assert not any(k.startswith("proj") or "glyph" in k for k in model.state_dict())


def test_compiled_blocks_train_as_the_eager_model_does(tmp_path):
    # Could fail if --compile compiled nothing (no block found), changed what a step computes (the losses of the
    # same steps from the same seed would part from eager's beyond float summation order), broke the evaluation's
    # decoding (which runs eager), or went unrecorded on the card.
    from torch._dynamo.utils import counters

    args = ["--size", "geodraw-tiny", "--data", "fixed", "--problems", "8", "--batch", "8", "--steps", "4",
            "--lr", "3e-3", "--warmup", "1", "--image-size", str(SIDE), "--eval-problems", "4", "--log-every", "1",
            "--device", "cpu"]
    eager = script.main(args + ["--out", str(tmp_path / "eager")])
    torch._dynamo.reset()
    counters.clear()
    compiled = script.main(args + ["--out", str(tmp_path / "compiled"), "--compile"])
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks ran compiled
    assert [d["loss"] for d in compiled["loss_log"]] == pytest.approx([d["loss"] for d in eager["loss_log"]],
                                                                       rel=1e-3)
    assert compiled["compile"] and not eager["compile"]
    assert 0 <= compiled["eval"]["greedy_acc"] <= 1
    assert "repeated blocks compiled (--compile)" in (tmp_path / "compiled" / "TRAINING.md").read_text()
    # the compiled run saves the weights under the model's own names, so RL loads its policy as an eager one's
    from safetensors import safe_open
    names = {n: set(safe_open(tmp_path / n / "model.safetensors", "pt").keys()) for n in ("eager", "compiled")}
    assert names["compiled"] == names["eager"] and not any("_orig_mod" in k for k in names["compiled"])


def test_save_at_keeps_the_policy_a_shorter_run_ends_with(tmp_path):
    # Could fail if a snapshot were saved before or after its step, if saving and evaluating it changed the training
    # that follows (model left in eval mode, RNG drawn), or if its card were missing: a snapshot after step 3 of a
    # 5-step stop must be the policy that --stop-after 3 of the same planned schedule saves.
    common = ["--size", "geodraw-tiny", "--data", "fixed", "--problems", "8", "--batch", "8", "--steps", "12",
              "--lr", "3e-3", "--warmup", "2", "--image-size", str(SIDE), "--eval-problems", "4", "--device", "cpu"]
    script.main(common + ["--out", str(tmp_path / "long"), "--stop-after", "5", "--save-at", "3"])
    script.main(common + ["--out", str(tmp_path / "short"), "--stop-after", "3"])
    snap = AutoModelForImageTextToText.from_pretrained(tmp_path / "long" / "step_3").state_dict()
    short = AutoModelForImageTextToText.from_pretrained(tmp_path / "short").state_dict()
    end = AutoModelForImageTextToText.from_pretrained(tmp_path / "long").state_dict()
    assert snap.keys() == short.keys()
    assert all(torch.equal(snap[k], short[k]) for k in snap)
    assert not all(torch.equal(snap[k], end[k]) for k in snap)  # the run went on after the snapshot
    card = json.loads((tmp_path / "long" / "step_3" / "training.json").read_text())
    assert card["step"] == 3 and 0 <= card["greedy_acc_128"] <= 1
    assert AutoProcessor.from_pretrained(tmp_path / "long" / "step_3").image_processor.size["longest_edge"] == SIDE ** 2


def test_build_script_keeps_second_stage_snapshots(tmp_path):
    # Could fail if STAGE2_SAVE_AT did not reach the second stage, reached the first too, or broke the build.
    import os
    import subprocess

    out = tmp_path / "policy"
    flags = ["--size", "geodraw-tiny", "--data", "fixed", "--problems", "8", "--batch", "8", "--steps", "6",
             "--stop-after", "3", "--warmup", "1", "--image-size", str(SIDE), "--eval-problems", "4", "--device", "cpu",
             "--data-workers", "0"]
    subprocess.run(["bash", str(ROOT / "scripts" / "build_geodraw_policy.sh"), str(out), *flags], check=True,
                   env={**os.environ, "STAGE2_SAVE_AT": "2"}, capture_output=True)
    assert json.loads((out / "step_2" / "training.json").read_text())["step"] == 2
    assert (out / "stage1" / "model.safetensors").exists() and not (out / "stage1" / "step_2").exists()
    assert json.loads((out / "training.json").read_text())["steps"] == 3
