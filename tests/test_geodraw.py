"""The geodraw task (tasks/geodraw/task.py): procedurally drawn geometry diagrams whose numbers are written only
in the image. Generated offline from a seed, graded by the Geometry3K choice verifier, trained on by a tiny
Qwen2.5-VL through the real trainer. Nothing mocked."""
import random
import re
from collections import Counter

import pytest
import torch

import hostile
from bapo_vl.cli import main
from bapo_vl.config import load_config
from bapo_vl.plugins import discover, get_task
from bapo_vl.problem import Verdict
from bapo_vl.reader import read_run
from bapo_vl.verifiers import choice

TASK = get_task("geodraw")
task = TASK.module


@pytest.fixture(scope="module")
def train400():
    return task.load(split="train", limit=400)


def question_part(p) -> str:
    """The text before the choices (letter template) or the instruction (value template)."""
    return p.text.split("\nChoices:")[0].split("\nThink step by step")[0]


def expected_answer(spec: dict):
    """The right value, worked out from the drawing's numbers here (not by the task's code)."""
    kind, sub = spec["kind"], spec["sub"]
    if kind == "triangle":
        written = [a for i, a in enumerate(spec["angles"]) if i != spec["x_vertex"]]
        assert sum(spec["angles"]) == 180  # the drawn triangle has the angles it shows
        return 180 - sum(written)
    if kind == "parallel":  # corners 0, 2 of either crossing are equal; 1, 3 are their supplement
        same = spec["written_corner"] % 2 == spec["x_corner"] % 2
        return spec["written"] if same else 180 - spec["written"]
    if kind == "circle":
        return spec["given"] // 2 if sub == "radius" else 2 * spec["given"]
    return spec["w"] * spec["h"] if sub == "area" else 2 * (spec["w"] + spec["h"])


def given_numbers(spec: dict) -> list[int]:
    """The numbers written in the diagram."""
    if spec["kind"] == "triangle":
        return [a for i, a in enumerate(spec["angles"]) if i != spec["x_vertex"]]
    if spec["kind"] == "parallel":
        return [spec["written"]]
    if spec["kind"] == "circle":
        return [spec["given"]]
    return [spec["w"], spec["h"]]


# --- generation ------------------------------------------------------------------------------------------------

def test_same_seed_gives_identical_problems_and_another_seed_does_not():
    # Could fail if anything in generation or drawing used unseeded randomness or process state (hash order).
    a, b = task.load(split="train", limit=24), task.load(split="train", limit=24)
    assert [p.uid for p in a] == [f"geodraw-train-{i}" for i in range(24)]
    assert [p.messages for p in a] == [p.messages for p in b] and [p.answer for p in a] == [p.answer for p in b]
    assert [p.images[0].tobytes() for p in a] == [p.images[0].tobytes() for p in b]
    assert all(p.images[0].mode == "RGB" and p.images[0].size == (224, 224) for p in a)
    # the recipe in meta redraws the same image
    assert all(task.render(p.meta["spec"]).tobytes() == p.images[0].tobytes() for p in a[:6])
    other = task.load(split="train", limit=24, seed=1)
    assert sum(x.images[0].tobytes() == y.images[0].tobytes() for x, y in zip(a, other)) == 0
    assert [p.text for p in a] != [p.text for p in other]


DIGEST = """
import hashlib, sys
from bapo_vl.plugins import get_task
problems = get_task("geodraw").load(split=sys.argv[1], limit=12)
print(hashlib.sha256(b"".join(p.images[0].tobytes() + p.text.encode() for p in problems)).hexdigest())
"""


def test_another_process_draws_the_same_bytes():
    # Could fail if generation depended on the process (string hashing order, caches filled in another order).
    import hashlib
    import os
    import subprocess
    import sys

    here = hashlib.sha256(b"".join(p.images[0].tobytes() + p.text.encode()
                                   for p in task.load(split="test", limit=12))).hexdigest()
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", DIGEST, "test"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here


def test_limit_keeps_a_prefix():
    # Could fail if `limit` changed the stream (e.g. sized a pool from it) instead of only stopping early.
    short, long = task.load(split="test", limit=7), task.load(split="test", limit=30)
    assert len(short) == 7 and len(long) == 30
    assert [(p.uid, p.text, p.answer) for p in short] == [(p.uid, p.text, p.answer) for p in long[:7]]
    assert [p.images[0].tobytes() for p in short] == [p.images[0].tobytes() for p in long[:7]]
    assert len(task.load(split="val", n=5)) == 5 and len(task.load(split="val", n=50, limit=3)) == 3


def test_train_val_and_test_are_disjoint():
    # Could fail if the held-out splits were only other seeds of the same stream (overlapping problems), or if a
    # train problem's drawn parameters (its key) could land in test.
    train = task.load(split="train", limit=4000, blank_images=True)  # the same problems, no drawing: fast
    test = task.load(split="test", blank_images=True)
    val = task.load(split="val", blank_images=True)
    assert len(test) == len(val) == 500
    keys = {s: {tuple(p.meta["key"]) for p in ps} for s, ps in (("train", train), ("test", test), ("val", val))}
    assert not keys["train"] & keys["test"] and not keys["train"] & keys["val"] and not keys["val"] & keys["test"]
    assert all(task.split_of(k) == s for s, ks in keys.items() for k in ks)
    # the held-out splits are real hold-outs: every kind is there, with its own keys
    assert {p.meta["kind"] for p in test} == set(task.KINDS) == {p.meta["kind"] for p in val}
    # one problem (text + key) is never asked in two splits
    ident = lambda p: (p.text, tuple(p.meta["key"]))  # noqa: E731
    assert not {ident(p) for p in train} & {ident(p) for p in test}


def test_right_answer_is_among_the_choices_and_letters_are_balanced(train400):
    # Could fail if the right choice were placed off-uniformly (a letter prior to exploit), if an answer were not
    # among the choices, if two choices were equal, or if the drawing did not give the stated answer.
    letters = Counter()
    per_kind = Counter()
    for p in train400:
        a, spec = p.answer, p.meta["spec"]
        right = "ABCD".index(a["letter"])
        assert a["choices"][right] == a["value"]
        assert len(set(a["choices"])) == 4 and a["precise_values"] == sorted(a["precise_values"])
        want = expected_answer(spec)
        assert a["value"] == (f"{want} \\pi" if spec["sub"] == "circumference" else str(want)), p.uid
        assert f"{a['letter']}. {a['value']}\n" in p.text
        letters[a["letter"]] += 1
        per_kind[p.meta["kind"]] += 1
    assert all(70 <= letters[x] <= 130 for x in "ABCD"), letters
    assert all(60 <= per_kind[k] <= 140 for k in task.KINDS), per_kind


def test_numbers_that_decide_the_answer_are_only_in_the_diagram(train400):
    # Could fail if a question leaked a written number (or any digit) into the text, so that the text alone
    # could be solved.
    for p in train400:
        q = question_part(p)
        assert not re.search(r"\d", q), (p.uid, q)
        assert all(str(n) not in q for n in given_numbers(p.meta["spec"]))
    value = task.load(split="train", limit=20, template="value")
    for p in value:
        assert "Choices" not in p.text and not re.search(r"\d", question_part(p)) and "\\boxed{}" in p.text


def test_the_text_alone_does_not_decide_the_answer():
    # Could fail if the choices leaked the answer (e.g. the right one always in the middle of its neighbours):
    # the same question with the same choices must come with different right letters, told apart by the image.
    problems = task.load(split="train", limit=1500, blank_images=True)
    by_text = {}
    for p in problems:
        by_text.setdefault(p.text, set()).add(p.answer["letter"])
    repeated = [letters for letters in by_text.values() if len(letters) > 1]
    assert len(repeated) >= 5, "no two problems share a text with different answers"
    # choices are in ascending order, so "the smallest / 2nd / 3rd / largest choice" is a letter: each ~1/4
    letters = Counter(p.answer["letter"] for p in problems)
    assert all(0.2 <= letters[x] / len(problems) <= 0.3 for x in "ABCD"), letters


def test_the_image_shows_the_numbers():
    # Could fail if the drawing ignored a parameter (the same picture for other numbers), or blank_images drew.
    (tri,) = task.load(split="train", limit=1, kinds=["triangle"])
    spec = dict(tri.meta["spec"])
    i, j = [k for k in range(3) if k != spec["x_vertex"]]
    changed = list(spec["angles"])
    changed[i], changed[j] = changed[i] + 1, changed[j] - 1  # the same triangle, almost: other numbers written
    a, b = task.render(spec), task.render({**spec, "angles": changed})
    diff = sum(x != y for x, y in zip(a.tobytes(), b.tobytes()))
    assert diff > 50
    for kind, field in (("circle", "given"), ("rectangle", "w")):
        (p,) = task.load(split="train", limit=1, kinds=[kind])
        spec = p.meta["spec"]
        assert task.render({**spec, field: spec[field] + 1}).tobytes() != p.images[0].tobytes()
        assert task.render(dict(spec)).tobytes() == p.images[0].tobytes()
    # a diagram has ink (black pixels) where blank has none; the same problems otherwise
    drawn = task.load(split="train", limit=8)
    blank = task.load(split="train", limit=8, blank_images=True)
    assert [(p.uid, p.text, p.answer) for p in drawn] == [(p.uid, p.text, p.answer) for p in blank]
    for d, b in zip(drawn, blank):
        assert b.images[0].getextrema() == ((255, 255),) * 3 and b.meta["blank"]
        assert d.images[0].convert("L").histogram()[0:64] != [0] * 64  # some dark pixels: lines and digits
    # bigger images are the same drawing, scaled
    (big,) = task.load(split="train", limit=1, image_size=448)
    assert big.images[0].size == (448, 448) and big.text == drawn[0].text


def test_messages_are_built_as_geometry3k_builds_them(train400):
    # Could fail if the prompt drifted from the Geometry3K layout that VL policies and check_prompt_fits expect.
    g3k = get_task("geometry3k").module
    for p in train400[:20]:
        q = question_part(p)
        assert p.messages == g3k.make_messages(q, p.answer["choices"], "letter", 1)
        assert [c["type"] for c in p.messages[0]["content"]] == ["image", "text"] and len(p.images) == 1


def test_bad_options_are_refused():
    for kwargs, says in [({"source": "/tmp/x"}, "reads no source"), ({"split": "dev"}, "unknown split"),
                         ({"template": "free"}, "unknown template"), ({"kinds": ["hexagon"]}, "kinds"),
                         ({"limit": -1}, "limit"), ({"image_size": 10}, "image_size"), ({"seed": "a"}, "seed")]:
        with pytest.raises(ValueError, match=says):
            task.load(**kwargs)
    with pytest.raises(TypeError):
        task.load(split="train", colour="red")  # an unknown task option is not silently ignored


# --- grading ---------------------------------------------------------------------------------------------------

def test_verifier_grades_the_right_choice_and_only_it(train400):
    # Could fail if the task's answer format did not fit the choice verifier (letters or values misread).
    for p in train400[:120]:
        a = p.answer
        right = "ABCD".index(a["letter"])
        assert TASK.verify(f"x = ... so <answer>{a['letter']}</answer>", a) is Verdict.CORRECT
        assert TASK.verify(f"<answer>{a['value']}</answer>", a) is Verdict.CORRECT
        assert TASK.verify("\\boxed{" + a["value"].replace(" ", "") + "}", a) is Verdict.CORRECT
        assert TASK.verify(f"The answer is {a['precise_values'][right]:.2f}.", a) is Verdict.CORRECT
        for i, other in enumerate(a["choices"]):
            if i != right:
                assert TASK.verify(f"<answer>{'ABCD'[i]}</answer>", a) is Verdict.WRONG
                assert TASK.verify(f"<answer>{other}</answer>", a) is Verdict.WRONG
        wrong = "ABCD"[(right + 1) % 4]
        for hedge in (f"<answer>{a['letter']} or {wrong}</answer>", "<answer>A B C D</answer>",
                      f"<answer>({a['letter']}) ({wrong})</answer>", "\\boxed{(A)(B)(C)(D)}"):
            assert TASK.verify(hedge, a) is not Verdict.CORRECT, hedge
        assert TASK.verify("no final answer", a) is Verdict.UNPARSABLE


def test_hostile_responses_never_raise_and_never_pass(train400):
    # Could fail if a geodraw ground truth (e.g. the "14 \\pi" choices) opened a hole in the choice verifier:
    # seeded hostile responses (tests/hostile.py: hedges, near values, smuggled golds, 100 kB strings ...) each
    # judged by its independent oracle; the unguarded verifier must not raise, the plugin's verify never.
    answers = [p.answer for p in train400]
    cases = list(hostile.choice_cases(random.Random(7), 3000, answers))
    counts = Counter()
    for case in cases:
        verdict = choice._verify(case.response, case.answer, choice.LETTERS)  # raises if anything is wrong
        assert TASK.verify(case.response, case.answer) is verdict
        counts[case.label, verdict is Verdict.CORRECT] += 1
        assert not (case.label == "wrong" and verdict is Verdict.CORRECT), (case.form, case.response[-200:])
    assert counts["wrong", False] >= 3000
    assert counts["right", True] >= 0.95 * (counts["right", True] + counts["right", False])  # controls pass


# --- the plugin ------------------------------------------------------------------------------------------------

def test_found_by_the_plugin_machinery_and_listed(capsys):
    # Could fail if the plugin broke the contract (checked at discovery) or `bapo tasks` did not list it.
    tasks, errors = discover()
    assert "geodraw" in tasks and not [e for e in errors if "geodraw" in e.origin]
    assert TASK.name == "geodraw" and TASK.eval_splits == ["test"] and TASK.version
    assert TASK.origin.endswith("tasks/geodraw")
    main(["tasks"])
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "geodraw" in lines and "test" in lines["geodraw"]
    # `bapo eval`'s loader gets the declared eval split, limited
    from bapo_vl.evaluate import load_sets

    sets = load_sets(TASK, TASK.eval_splits, {}, limit=4)
    assert [p.uid for p in sets["test"]] == [f"geodraw-test-{i}" for i in range(4)]


# --- training ----------------------------------------------------------------------------------------------------

MAX_PIXELS = 112 * 112  # a 224 px diagram becomes 16 image tokens


def prime_to_answer_letters(model, processor, problems, steps=40, seed=0):
    """A few supervised steps so the random model answers `<answer>X` (an unclosed tag counts: shorter to learn)
    with a random letter: its groups then have mixed rewards, which BAPO needs to train on (as tests/test_vl.py
    does; here each step is one prompt with all four letters, and the encodings are made once)."""
    batches = []
    for p in problems:
        prompt = processor.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)
        n_prompt = len(processor(text=[prompt], images=p.images, return_tensors="pt")["input_ids"][0])
        enc = processor(text=[prompt + f"<answer>{x}<|im_end|>" for x in "ABCD"], images=p.images * 4,
                        return_tensors="pt")
        labels = enc["input_ids"].clone()
        labels[:, :n_prompt] = -100
        batches.append((enc, labels))
    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    for _ in range(steps):
        enc, labels = rng.choice(batches)
        loss = model(**enc, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def test_tiny_qwen2_5_vl_trains_on_geodraw(tmp_path):
    # Could fail if the drawn images did not go through the processor, generation, verification and the update of
    # the real trainer, or if the run record lacked the steps or had a non-finite loss.
    from bapo_vl.tiny import build_qwen2_5_vl
    from bapo_vl.train import train

    problems = task.load(split="train", limit=6)
    model, processor = build_qwen2_5_vl(max_pixels=MAX_PIXELS)
    prime_to_answer_letters(model, processor, problems)
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    cfg = load_config(overrides=[
        "task=geodraw", "task_options={limit: 6}", f"model={tmp_path / 'vl'}", f"run_dir={tmp_path / 'runs'}",
        "name=geodraw", "device=cpu", "dtype=float32", "steps=3", "batch_size=2", "group_size=4", "delay=1",
        "max_response_length=24", "max_prompt_length=512", f"max_pixels={MAX_PIXELS}", "mini_batch_size=2",
        "micro_batch_size=8", "lr=1e-3", "kl_coef=0.001", "entropy_coef=0.001", "temperature=0.5"])
    run = read_run(train(cfg, quiet=True))
    steps = run["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3] and run["meta"]["status"] == "finished"
    assert run["config"]["task"] == "geodraw" and run["meta"]["verifier_version"] == task.VERSION
    assert all(s["rollouts_fresh"] == 8 for s in steps)  # 2 drawn prompts x 4 responses verified per step
    assert sum(s["x1"] + s["x2"] + s["x3"] for s in steps) > 0, "no group was ever trained on"
    assert any(0 < s["fresh_reward"] < 1 for s in steps)  # some answers right, some wrong: graded from the image
    losses = [s["loss"] for s in steps if s.get("loss") is not None]
    assert losses and all(torch.isfinite(torch.tensor(x)) for x in losses), steps
