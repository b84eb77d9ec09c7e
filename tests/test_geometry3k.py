"""Geometry3K: the choice verifier (letters and values), the three data layouts, malformed rows, prompt length."""
import json
import logging
import shutil
import time
from pathlib import Path

import pytest

from bapo_vl.plugins import get_task, load_folder
from bapo_vl.problem import Problem, Verdict
from bapo_vl.verifiers.choice import extract_answer, extract_choice, parse_number, verify

ROOT = Path(__file__).resolve().parents[1]
# 3 train problems (data.json as published): diagrams downscaled to 160 px, saved as a palette PNG (7), an opaque
# RGBA PNG like most of the dataset (73) and an RGBA PNG with a transparent background over black (139)
FIXTURES = ROOT / "tests" / "fixtures" / "geometry3k"
SIZES = {"train": 2101, "val": 300, "test": 601}
task = load_folder(ROOT / "tasks" / "geometry3k").module

def timed_verify(response, answer):
    t = time.perf_counter()
    verdict = verify(response, answer)
    assert time.perf_counter() - t < 0.05, f"verify took too long on {str(response)[:60]!r}"
    return verdict


# --- verifier -------------------------------------------------------------------------------------------------

SQRT = {"letter": "B", "value": "2 \\sqrt { 3 }", "choices": ["3", "2 \\sqrt { 3 }", "4", "6"]}
DEG = {"letter": "B", "value": "60", "choices": ["30", "60", "90", "120"]}
FRAC = {"letter": "B", "value": "\\frac { 3 } { 7 }",
        "choices": ["\\frac { 1 } { 7 }", "\\frac { 3 } { 7 }", "\\frac { 4 } { 7 }", "\\frac { 5 } { 7 }"]}
NEAR = {"letter": "A", "value": "12.9", "choices": ["12.9", "13", "17.9", "35.8"]}
DUP = {"letter": "A", "value": "30", "choices": ["30", "30", "60", "90"]}  # train 1516: A and B are both 30
TEXT = {"letter": "D", "value": "not enough information",
        "choices": ["15", "25", "88.5", "not enough information"]}  # train 1637
PI = {"letter": "B", "value": "\\frac { \\pi } { 4 }",
      "choices": ["\\frac { \\pi } { 6 }", "\\frac { \\pi } { 4 }", "\\frac { 3 \\pi } { 5 }", "\\frac { 9 \\pi } { 10 }"]}

CORRECT = [
    ("<answer>B</answer>", SQRT),
    ("<answer> (B) </answer>", SQRT),
    ("<answer>b</answer>", SQRT),  # a lone lower-case letter
    ("\\boxed{B}", SQRT),
    ("\\boxed{\\text{B}}", SQRT),
    ("So the answer is B.", SQRT),
    ("Answer: (B)", SQRT),
    ("**Answer:** B", SQRT),
    ("<answer>The answer is B.</answer>", SQRT),
    ("<answer>A</answer> no, wait: <answer>B</answer>", SQRT),  # the last answer counts
    ("<answer>2\\sqrt{3}</answer>", SQRT),  # the value, compact
    ("<answer>2 \\sqrt { 3 }</answer>", SQRT),  # the value as the choice writes it
    ("\\boxed{2\\sqrt3}", SQRT),
    ("<answer>$2\\sqrt{3}$</answer>", SQRT),
    ("<answer>x = 2\\sqrt{3}</answer>", SQRT),
    ("<answer>3.46</answer>", SQRT),  # rounded
    ("<answer>\\sqrt{12}</answer>", SQRT),  # another form of the same number
    ("<answer>B. 2\\sqrt{3}</answer>", SQRT),
    ("<answer>2√3</answer>", SQRT),
    ("<answer>60^\\circ</answer>", DEG),
    ("<answer>60°</answer>", DEG),
    ("\\boxed{60^{\\circ}}", DEG),
    ("<answer>60 degrees</answer>", DEG),
    ("\\boxed{\\frac{3}{7}}", FRAC),
    ("\\boxed{\\dfrac{3}{7}}", FRAC),
    ("<answer>3/7</answer>", FRAC),
    ("<answer>0.43</answer>", FRAC),
    ("<answer>0.429</answer>", FRAC),
    ("<answer>12.9</answer>", NEAR),  # within 1% of 13 too, but 12.9 is nearer
    ("<answer>12.94</answer>", NEAR),
    ("<answer>30</answer>", DUP),  # the right value, though B has it too
    ("<answer>A</answer>", DUP),
    ("<answer>Not enough information</answer>", TEXT),
    ("<answer>D</answer>", TEXT),
    ("\\boxed{\\frac{\\pi}{4}}", PI),
    ("\\boxed{0.785}", PI),
    ("<answer>C</answer>", "C"),  # a plain letter ground truth still works
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}"),  # a value-only ground truth (no choices known)
    ("\\boxed{3.46}", "2\\sqrt{3}"),
    ("The final answer is $2\\sqrt{3}$. I hope it is correct.", "2\\sqrt{3}"),
]

WRONG = [
    ("<answer>A</answer>", SQRT),
    ("<answer>D</answer>", SQRT),
    ("<answer>B</answer> no, wait: <answer>A</answer>", SQRT),
    ("<answer>3</answer>", SQRT),  # another choice's value
    ("<answer>6</answer>", SQRT),
    ("<answer>5</answer>", SQRT),  # near no choice
    ("<answer>C. 4</answer>", SQRT),
    ("<answer>\\sqrt{3}</answer>", SQRT),
    ("<answer>13</answer>", NEAR),
    ("<answer>90^\\circ</answer>", DEG),
    ("\\boxed{\\frac{1}{7}}", FRAC),
    ("<answer>0.14</answer>", FRAC),
    ("<answer>B</answer>", DUP),  # the letter is judged as a letter
    ("<answer>60</answer>", DUP),
    ("<answer>15</answer>", TEXT),
    ("<answer>enough information</answer>", TEXT),  # free text to a problem with a text choice
    ("\\boxed{\\frac{\\pi}{6}}", PI),
    ("<answer>A</answer>", "C"),
    ("\\boxed{3.5}", "2\\sqrt{3}"),
    ("\\boxed{4}", "2\\sqrt{3}"),
    ("\\boxed{121}", "120"),  # an integer gold has no tolerance (more in test_choice_soundness.py)
    ("<answer>3.49</answer>", {"letter": "A", "value": "3.46", "choices": ["3.46", "3.5", "4", "6"]}),  # nearer B
    ("<answer>(A) (B) (C) (D)</answer>", SQRT),  # a hedge
    ("<answer>A) or B)</answer>", SQRT),
]

UNPARSABLE = [
    ("", SQRT),
    ("I think it is two root three", SQRT),
    ("<answer></answer>", SQRT),
    ("<answer>I cannot tell</answer>", SQRT),
    ("<answer>x</answer>", SQRT),
    ("<answer>E</answer>", SQRT),  # not a choice letter
    ("<answer>__import__('os').system('echo hi')</answer>", SQRT),  # never evaluated
    ("<answer>" + "(" * 500 + "1" + ")" * 500 + "</answer>", SQRT),  # too deep for the number parser
    ("<answer>9^9^9^9</answer>", SQRT),  # power out of range
    ("<answer>1/0</answer>", SQRT),
    ("<answer>C</answer>", "2\\sqrt{3}"),  # a letter, but no choices are known
    ("<answer>15</answer>", "C"),  # a value, but only the letter is known
    (None, SQRT),
    (12, SQRT),
]


@pytest.mark.parametrize("response,answer", CORRECT)
def test_correct(response, answer):
    assert timed_verify(response, answer) is Verdict.CORRECT


@pytest.mark.parametrize("response,answer", WRONG)
def test_wrong(response, answer):
    assert timed_verify(response, answer) is Verdict.WRONG


@pytest.mark.parametrize("response,answer", UNPARSABLE)
def test_unparsable(response, answer):
    assert timed_verify(response, answer) is Verdict.UNPARSABLE


@pytest.mark.parametrize("response", [
    "<answer>" * 20_000, "\\boxed{" * 20_000, "answer is " * 5_000, "x" * 10**6 + "<answer>B</answer>",
    "<answer>" + "1+" * 10_000 + "1</answer>", "<answer>" + "\\sqrt{" * 3000 + "</answer>",
    "<answer>" + " a" * 10_000 + "</answer>", "\x00\udcff<answer>\ud800</answer>",
])
def test_hostile_input_is_fast_and_never_raises(response):
    verdict = timed_verify(response, SQRT)
    assert verdict in (Verdict.UNPARSABLE, Verdict.WRONG, Verdict.CORRECT)


def test_extract_helpers():
    assert extract_choice("so x = 15. <answer>C</answer>") == "C"
    assert extract_choice("<answer>15</answer>") is None
    assert extract_choice("<answer>(D) 35</answer>") == "D"
    assert extract_answer("first \\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_answer("<answer>oops <answer>12</answer>") == "12"
    assert parse_number("2 \\sqrt { 3 }") == pytest.approx(3.4641016)
    assert parse_number("\\frac { 15 \\sqrt 2 } { 2 }") == pytest.approx(10.6066017)
    assert parse_number("\\frac { 9 \\pi } { 10 }") == pytest.approx(2.8274334)
    assert parse_number("16 - 16 \\pi") == pytest.approx(16 - 16 * 3.14159265)
    assert parse_number("\\sqrt[3]{27}") == pytest.approx(3)
    assert parse_number("1,000") == 1000 and parse_number("1 : 3") == pytest.approx(1 / 3)
    assert parse_number("2 3") is None and parse_number("x + 1") is None and parse_number("") is None


# --- loading: the committed fixtures (no dataset needed) -----------------------------------------------------

def test_fixture_problems_load_and_verify():
    problems = task.load(split="train", source=str(FIXTURES))
    assert [p.uid for p in problems] == ["geometry3k-train-7", "geometry3k-train-73", "geometry3k-train-139"]
    for p in problems:
        (image,) = p.images
        assert image.mode == "RGB" and image.width > 0 and image.height > 0
        content = p.messages[0]["content"]
        assert p.messages[0]["role"] == "user" and content[0] == {"type": "image"} and content[1]["type"] == "text"
        assert "Choices:\nA. " in content[1]["text"] and "<answer>" in content[1]["text"]
        a = p.answer
        assert set(a) >= {"letter", "value", "choices"} and a["value"] == a["choices"]["ABCD".index(a["letter"])]
        assert p.meta["split"] == "train" and p.meta["choices"] == a["choices"]
        assert task.verify(f"<answer>{a['letter']}</answer>", a) is Verdict.CORRECT
        assert task.verify(f"\\boxed{{{a['value']}}}", a) is Verdict.CORRECT
        for other in set("ABCD") - {a["letter"]}:
            assert task.verify(f"<answer>{other}</answer>", a) is Verdict.WRONG
    assert problems[0].answer == {
        "letter": "B", "value": "\\frac { 3 } { 7 }", "precise_values": pytest.approx([1 / 7, 3 / 7, 4 / 7, 5 / 7]),
        "choices": ["\\frac { 1 } { 7 }", "\\frac { 3 } { 7 }", "\\frac { 4 } { 7 }", "\\frac { 5 } { 7 }"]}
    assert problems[2].images[0].getpixel((0, 0)) == (255, 255, 255)  # transparent -> white, not black
    assert task.load(split="train", source=str(FIXTURES), limit=2)[1].uid == "geometry3k-train-73"
    assert get_task("geometry3k").name == "geometry3k"


def test_value_template():
    (p,) = task.load(split="train", source=str(FIXTURES), limit=1, template="value")
    text = p.text
    assert "\\boxed{}" in text and "Choices" not in text and p.meta["template"] == "value"
    assert task.verify("\\boxed{\\frac{3}{7}}", p.answer) is Verdict.CORRECT
    with pytest.raises(ValueError, match="template"):
        task.load(split="train", source=str(FIXTURES), template="free")


def test_missing_source_and_split():
    with pytest.raises(ValueError, match="source"):
        task.load(split="train")
    with pytest.raises(FileNotFoundError, match="no split 'test'"):
        task.load(split="test", source=str(FIXTURES))


# --- every problem of the real data ----------------------------------------------------------------------------

def real_geometry3k(shared_data: Path) -> Path:
    """The full dataset in the Inter-GPS layout, from conftest's shared_data (skips where it is absent)."""
    folder = shared_data / "geometry3k"
    if not folder.is_dir():
        pytest.skip(f"{folder} is not present")
    return folder


def test_every_problem_of_the_three_splits(capsys, shared_data):
    data = real_geometry3k(shared_data)
    counts = {}
    t0 = time.perf_counter()
    for split, size in SIZES.items():
        problems = task.load(split=split, source=str(data))
        assert len(problems) == size and len({p.uid for p in problems}) == size
        c = dict(problems=0, letter_ok=0, value_ok=0, rounded_ok=0, other_letters_wrong=0, other_values_wrong=0,
                 shared_value=0, text_choices=0)
        for p in problems:
            (image,) = p.images
            assert image.mode == "RGB" and image.width > 0 and image.height > 0, p.uid
            a = p.answer
            right = "ABCD".index(a["letter"])
            assert timed_verify(f"<answer>{a['letter']}</answer>", a) is Verdict.CORRECT, p.uid
            assert timed_verify(f"<answer>{a['value']}</answer>", a) is Verdict.CORRECT, p.uid
            assert timed_verify("\\boxed{" + a["value"].replace(" ", "") + "}", a) is Verdict.CORRECT, p.uid
            c["problems"] += 1
            c["letter_ok"] += 1
            c["value_ok"] += 1
            pv = (a["precise_values"] or [None] * 4)[right]
            if pv is not None and timed_verify(f"<answer>{pv:.2f}</answer>", a) is Verdict.CORRECT:
                c["rounded_ok"] += 1
            c["text_choices"] += parse_number(a["value"]) is None
            for i, choice in enumerate(a["choices"]):
                if i == right:
                    continue
                assert timed_verify(f"<answer>{'ABCD'[i]}</answer>", a) is Verdict.WRONG, (p.uid, i)
                c["other_letters_wrong"] += 1
                same = choice.replace(" ", "") == a["value"].replace(" ", "") or (
                    parse_number(choice) is not None and parse_number(choice) == parse_number(a["value"]))
                if same:  # a choice that repeats the right value: naming that value is right
                    c["shared_value"] += 1
                    assert timed_verify(f"<answer>{choice}</answer>", a) is Verdict.CORRECT, (p.uid, i)
                else:
                    assert timed_verify(f"<answer>{choice}</answer>", a) is Verdict.WRONG, (p.uid, i)
                    c["other_values_wrong"] += 1
        counts[split] = c
    elapsed = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\ngeometry3k: {counts} in {elapsed:.1f}s")
    assert sum(c["problems"] for c in counts.values()) == 3002


def _disagreements(source: str) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """split/id -> the letters of the choices whose text reads as a number other than the data set's precise_value;
    and split/id -> the raw row of those problems."""
    found, rows = {}, {}
    for split in SIZES:
        for _, row, _, _ in task._rows(source, split):
            for letter, text, precise in zip("ABCD", row["choices"], row["precise_value"]):
                v = parse_number(text)
                if v is not None and isinstance(precise, (int, float)) and abs(v - precise) > 1e-6 * max(1, abs(v)):
                    found.setdefault(f"{split}/{row['id']}", []).append(letter)
                    rows[f"{split}/{row['id']}"] = row
    return found, rows


def test_choice_text_wins_over_the_precise_value_wherever_they_disagree(shared_data):
    """Geometry3K's precise_value reads test 2885's mixed numbers as products (4 \\frac { 4 } { 11 } as 16/11) and
    has three negative choices one off; the loader keeps the text's value, and TEXT_OVER_PRECISE lists them all."""
    found, rows = _disagreements(str(real_geometry3k(shared_data)))
    print(f"\nprecise_value != choice text: {found}")
    assert found == {"test/2885": ["A", "B", "D"], "train/798": ["A"], "train/1743": ["A"], "val/2315": ["A", "B"]}
    assert set(found) == set(task.TEXT_OVER_PRECISE)
    answers = {key: task._fields(row, None) for key, row in rows.items()}
    assert answers["test/2885"]["precise_values"] == pytest.approx([11 / 6, 48 / 11, 3, 44 / 3], rel=1e-12)
    assert answers["val/2315"]["precise_values"] == [-3, -1, 1, 6]
    for key, fields in answers.items():  # what the loader keeps now agrees with the text everywhere
        assert fields["precise_values"] == pytest.approx([parse_number(c) for c in fields["choices"]]), key
    a2885 = {k: answers["test/2885"][k] for k in ("letter", "value", "choices", "precise_values")}
    assert verify("\\boxed{\\frac{48}{11}}", a2885) is Verdict.CORRECT
    assert verify("\\boxed{\\frac{16}{11}}", a2885) is Verdict.WRONG


def test_loader_corrects_a_misread_mixed_number(tmp_path):
    """Without the real data: test 2885's row as published (precise_value 16/11 for "4 \\frac { 4 } { 11 }")."""
    _, png = fixture_rows()[0]
    (tmp_path / "d.png").write_bytes(png)
    row = {"id": 2885, "problem_text": "If pentagons A B C D E and P Q R S T are similar, find S R.", "answer": "B",
           "choices": ["1 \\frac { 5 } { 6 }", "4 \\frac { 4 } { 11 }", "3", "14 \\frac { 2 } { 3 }"],
           "precise_value": [0.8333333333333334, 1.4545454545454546, 3.0, 9.333333333333332], "image": "d.png"}
    (tmp_path / "test.jsonl").write_text(json.dumps(row) + "\n")
    (p,) = task.load(split="test", source=str(tmp_path))
    assert p.answer["precise_values"] == pytest.approx([11 / 6, 48 / 11, 3, 44 / 3], rel=1e-12)
    for response, verdict in [("\\boxed{\\frac{48}{11}}", Verdict.CORRECT), ("<answer>4.36</answer>", Verdict.CORRECT),
                              ("\\boxed{\\frac{16}{11}}", Verdict.WRONG), ("<answer>1.45</answer>", Verdict.WRONG),
                              ("<answer>B</answer>", Verdict.CORRECT)]:
        assert task.verify(response, p.answer) is verdict, response
    # a hiyouga-style row that gives the value, not the letter, finds the mixed-number choice by its text's value
    assert task._fields({**row, "answer": "\\frac{48}{11}"}, 0)["letter"] == "B"


def test_jsonl_layout_of_the_real_data_matches_the_folders(shared_data):
    data = real_geometry3k(shared_data)
    from_jsonl = task.load(split="val", source=str(data / "val.jsonl"), limit=20)
    from_folders = task.load(split="val", source=str(data), limit=20)
    assert [p.uid for p in from_jsonl] == [p.uid for p in from_folders]
    assert [p.answer for p in from_jsonl] == [p.answer for p in from_folders]
    assert [p.messages for p in from_jsonl] == [p.messages for p in from_folders]
    assert from_jsonl[0].images[0].tobytes() == from_folders[0].images[0].tobytes()


# --- the other layouts -----------------------------------------------------------------------------------------

def fixture_rows():
    """(data.json dict, PNG bytes) of each fixture problem."""
    out = []
    for folder in sorted((FIXTURES / "train").iterdir(), key=lambda d: int(d.name)):
        out.append((json.loads((folder / "data.json").read_text()), (folder / "img_diagram.png").read_bytes()))
    return out


def test_jsonl_layout(tmp_path):
    lines = []
    for row, png in fixture_rows():
        (tmp_path / "img").mkdir(exist_ok=True)
        (tmp_path / "img" / f"{row['id']}.png").write_bytes(png)
        lines.append(json.dumps({**row, "split": "train", "image": f"img/{row['id']}.png"}))
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    from_dir = task.load(split="train", source=str(tmp_path))
    from_file = task.load(split="train", source=str(tmp_path / "train.jsonl"))
    from_folders = task.load(split="train", source=str(FIXTURES))
    assert [p.uid for p in from_dir] == [p.uid for p in from_file] == [p.uid for p in from_folders]
    assert [p.answer for p in from_dir] == [p.answer for p in from_folders]
    assert [p.images[0].size for p in from_dir] == [p.images[0].size for p in from_folders]


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def hiyouga_rows(with_choices=True, raw_bytes=False):
    """Rows as hiyouga/geometry3k has them: answer = the right choice's value; choices/id/ground_truth in the
    current version only."""
    rows = []
    for row, png in fixture_rows():
        value = row["choices"]["ABCD".index(row["answer"])]
        images = [png] if raw_bytes else [{"bytes": png, "path": None}]
        r = {"images": images, "problem": "<image>" + row["problem_text"], "answer": value}
        if with_choices:
            r |= {"id": row["id"], "choices": row["choices"], "ground_truth": row["answer"]}
        rows.append(r)
    return rows


def test_parquet_layout_hiyouga(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", hiyouga_rows())
    problems = task.load(split="train", source=str(path))
    reference = task.load(split="train", source=str(FIXTURES))
    assert [p.uid for p in problems] == [p.uid for p in reference]
    assert [{k: p.answer[k] for k in ("letter", "value", "choices")} for p in problems] == \
        [{k: p.answer[k] for k in ("letter", "value", "choices")} for p in reference]
    assert [p.text for p in problems] == [p.text for p in reference]  # the <image> placeholder is dropped
    assert all(p.images[0].mode == "RGB" for p in problems)
    # a folder in the Hugging Face layout, with "validation" for "val"
    write_parquet(tmp_path / "hf" / "data" / "validation-00000-of-00001.parquet", hiyouga_rows())
    assert len(task.load(split="val", source=str(tmp_path / "hf"))) == 3


def test_parquet_layout_without_choices(tmp_path):
    """The older hiyouga/geometry3k: images (raw bytes here), problem, answer = value only."""
    path = write_parquet(tmp_path / "old.parquet", hiyouga_rows(with_choices=False, raw_bytes=True))
    problems = task.load(split="train", source=str(path))
    assert [p.uid for p in problems] == ["geometry3k-train-0", "geometry3k-train-1", "geometry3k-train-2"]
    p = problems[0]
    assert p.answer["letter"] is None and p.answer["choices"] is None and p.answer["value"] == "\\frac { 3 } { 7 }"
    assert p.meta["template"] == "value" and "\\boxed{}" in p.text
    assert task.verify("\\boxed{\\frac{3}{7}}", p.answer) is Verdict.CORRECT
    assert task.verify("\\boxed{0.43}", p.answer) is Verdict.CORRECT
    assert task.verify("\\boxed{\\frac{1}{7}}", p.answer) is Verdict.WRONG
    assert task.verify("<answer>B</answer>", p.answer) is Verdict.UNPARSABLE


def test_parquet_letter_answer_and_value_matched_to_choices(tmp_path):
    rows = hiyouga_rows()
    rows[0] = {**rows[0], "ground_truth": None, "answer": "3/7"}  # a value only: its choice is found
    rows[1] = {**rows[1], "ground_truth": None, "answer": "A"}  # a letter in `answer`
    problems = task.load(split="train", source=str(write_parquet(tmp_path / "t.parquet", rows)))
    assert problems[0].answer["letter"] == "B" and problems[1].answer["letter"] == "A"


def test_verl_preprocessed_parquet(tmp_path):
    rows = []
    for i, r in enumerate(hiyouga_rows(with_choices=False)):
        rows.append({"data_source": "hiyouga/geometry3k", "images": r["images"],
                     "prompt": [{"role": "user", "content": r["problem"] + " You FIRST think ... \\boxed{}."}],
                     "reward_model": {"style": "rule", "ground_truth": r["answer"]},
                     "extra_info": {"split": "train", "index": i, "answer": r["answer"], "question": r["problem"]}})
    problems = task.load(split="train", source=str(write_parquet(tmp_path / "verl.parquet", rows)))
    assert problems[2].uid == "geometry3k-train-2" and problems[0].answer["value"] == "\\frac { 3 } { 7 }"
    assert "You FIRST" not in problems[0].text


# --- malformed rows --------------------------------------------------------------------------------------------

def copy_fixtures(tmp_path) -> Path:
    shutil.copytree(FIXTURES, tmp_path / "g3k")
    return tmp_path / "g3k"


def test_relative_source_finds_the_images(tmp_path, monkeypatch):
    """A relative `source` (Inter-GPS folders, a jsonl file): each image path is joined to its base once."""
    copy_fixtures(tmp_path)
    rows = [{**row, "image": f"img/{row['id']}.png"} for row, _ in fixture_rows()]
    (tmp_path / "flat" / "img").mkdir(parents=True)
    for row, png in fixture_rows():
        (tmp_path / "flat" / "img" / f"{row['id']}.png").write_bytes(png)
    (tmp_path / "flat" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    absolute = task.load(split="train", source=str(FIXTURES))
    for source in ("g3k", "./g3k", "flat", "flat/train.jsonl"):
        problems = task.load(split="train", source=source)
        assert [p.uid for p in problems] == [p.uid for p in absolute], source
        assert [p.images[0].tobytes() for p in problems] == [p.images[0].tobytes() for p in absolute], source
    (tmp_path / "g3k" / "train" / "73" / "img_diagram.png").unlink()  # a really missing one is still named
    with pytest.raises(ValueError, match=r"g3k/train/73/data\.json: image g3k/train/73/img_diagram\.png is missing"):
        task.load(split="train", source="g3k")


def edit_json(path, **changes):
    row = json.loads(path.read_text())
    for k, v in changes.items():
        if v is ...:
            row.pop(k)
        else:
            row[k] = v
    path.write_text(json.dumps(row))


@pytest.mark.parametrize("breakage,message", [
    (lambda d: edit_json(d / "data.json", answer=...), "no answer"),
    (lambda d: edit_json(d / "data.json", answer="E"), "none of the choices|not one of"),
    (lambda d: edit_json(d / "data.json", answer=3), "none of the choices"),
    (lambda d: edit_json(d / "data.json", answer=["B"]), "answer must be"),
    (lambda d: edit_json(d / "data.json", choices="A B C D"), "choices must be"),
    (lambda d: edit_json(d / "data.json", choices=[1, 2, 3, 4]), "choices must be"),
    (lambda d: edit_json(d / "data.json", problem_text=None), "question"),
    (lambda d: edit_json(d / "data.json", precise_value=5), "precise_value"),
    (lambda d: (d / "data.json").write_text("{not json"), "invalid JSON|JSONDecodeError|Expecting"),
    (lambda d: (d / "data.json").write_text("[1, 2]"), "expected an object"),
    (lambda d: (d / "img_diagram.png").unlink(), "missing"),
    (lambda d: (d / "img_diagram.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage"), "unreadable"),
    (lambda d: (d / "img_diagram.png").write_bytes((d / "img_diagram.png").read_bytes()[:200]), "unreadable"),
])
def test_malformed_problem_names_its_file(tmp_path, caplog, breakage, message):
    root = copy_fixtures(tmp_path)
    broken = root / "train" / "73"
    breakage(broken)
    with pytest.raises(ValueError, match=message) as err:
        task.load(split="train", source=str(root))
    assert str(broken / "data.json") in str(err.value)
    with caplog.at_level(logging.WARNING, logger="bapo_vl.tasks.geometry3k"):
        problems = task.load(split="train", source=str(root), skip_bad=True)
    assert [p.uid for p in problems] == ["geometry3k-train-7", "geometry3k-train-139"]
    assert "skipped 1 malformed" in caplog.text


def test_malformed_parquet_rows_name_file_and_row(tmp_path, caplog):
    rows = hiyouga_rows()
    rows.append({**rows[0], "id": 1000, "images": [{"bytes": b"not a png", "path": None}]})
    rows.append({**rows[0], "id": 1001, "images": []})
    rows.append({**rows[0], "id": 1002, "answer": "99", "ground_truth": None})
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError, match=r"bad\.parquet: row 3 \(0-based\): image bytes .* unreadable"):
        task.load(split="train", source=str(path))
    with caplog.at_level(logging.WARNING, logger="bapo_vl.tasks.geometry3k"):
        problems = task.load(split="train", source=str(path), skip_bad=True)
    assert len(problems) == 3 and "skipped 3 malformed" in caplog.text
    assert len(task.load(split="train", source=str(path), skip_bad=True, limit=2)) == 2


def test_malformed_jsonl_row_names_file_and_row(tmp_path):
    row, png = fixture_rows()[0]
    (tmp_path / "d.png").write_bytes(png)
    good = json.dumps({**row, "image": "d.png"})
    (tmp_path / "train.jsonl").write_text(f"{good}\n{{oops\n")
    with pytest.raises(ValueError, match=r"train\.jsonl: row 1 \(0-based\): invalid JSON"):
        task.load(split="train", source=str(tmp_path))
    (tmp_path / "train.jsonl").write_text(json.dumps({**row, "image": "nothere.png"}) + "\n")
    with pytest.raises(ValueError, match=r"train\.jsonl: row 0 \(0-based\): image .*nothere\.png is missing"):
        task.load(split="train", source=str(tmp_path))


# --- prompt length (image tokens) ------------------------------------------------------------------------------

def big_image_problem() -> Problem:
    """A fixture problem whose diagram is enlarged: at max_pixels=448*448 it is 256 image tokens."""
    (p,) = task.load(split="train", source=str(FIXTURES), limit=1)
    p.images = [p.images[0].resize((448, 448))]
    return p


def test_check_prompt_fits_names_the_problem():
    from bapo_vl.tiny import build_processor
    p = big_image_problem()
    small = task.check_prompt_fits(p, build_processor(max_pixels=112 * 112), max_prompt_length=10_000)
    limit = small + 8  # the text and a 16-token image fit; 256 image tokens do not
    assert task.check_prompt_fits(p, build_processor(max_pixels=112 * 112), limit) == small
    with pytest.raises(ValueError, match=r"geometry3k-train-7 has \d+ tokens \(256 of them image tokens\).*"
                                         r"lower max_pixels .* or raise max_prompt_length"):
        task.check_prompt_fits(p, build_processor(max_pixels=448 * 448), limit)


def test_embedded_backend_reports_a_prompt_too_long_for_its_images(tmp_path):
    from bapo_vl.config import Config
    from bapo_vl.train import make_backend
    from bapo_vl.tiny import build_processor, build_qwen2_5_vl
    model, processor = build_qwen2_5_vl()
    model.save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")
    p = big_image_problem()
    small = task.check_prompt_fits(p, build_processor(max_pixels=112 * 112), max_prompt_length=10_000)

    def backend(max_pixels):
        return make_backend(Config.from_dict(dict(model=str(tmp_path / "vl"), device="cpu", delay=1, kl_coef=0.0,
                                                  max_prompt_length=small + 8, min_pixels=56 * 56,
                                                  max_pixels=max_pixels)))

    assert len(backend(112 * 112).encode(p)["input_ids"]) == small  # the same count as check_prompt_fits
    with pytest.raises(ValueError, match=r"prompt geometry3k-train-7 has \d+ tokens.*lower max_pixels"):
        backend(448 * 448).encode(p)
