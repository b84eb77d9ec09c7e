"""Soundness of the choice verifier (Geometry3K): constructed-wrong answers must not be CORRECT.

Three false-positive patterns found by fuzzing, each with a regression test, then a fuzz test over real problems
(Geometry3K's val split where the dataset is present, else the bundled fixtures): 0 false positives, 0 exceptions.
"""
import time
from pathlib import Path

import pytest

from bapo_vl.plugins import load_folder
from bapo_vl.problem import Verdict
from bapo_vl.verifiers import choice
from bapo_vl.verifiers.choice import extract_choice, parse_number

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "geometry3k"
task = load_folder(ROOT / "tasks" / "geometry3k").module

NOT_CORRECT = (Verdict.WRONG, Verdict.UNPARSABLE)


def _raw(response, answer):
    """The verdict without verify()'s exception guard, so that a raising verifier fails the test."""
    return choice._verify(response, answer, choice.LETTERS)


# --- 1. no choices: an integer / exact gold must match exactly; a decimal gold is a rounded value -----------

@pytest.mark.parametrize("response,gold", [
    ("\\boxed{121}", "120"), ("\\boxed{119}", "120"), ("\\boxed{1009}", "1000"), ("\\boxed{991}", "1000"),
    ("\\boxed{1001}", "1000"), ("\\boxed{120.5}", "120"), ("\\boxed{120.40}", "120"), ("\\boxed{61^\\circ}", "60"),
    ("\\boxed{3.5}", "2\\sqrt{3}"), ("\\boxed{3.47}", "2\\sqrt{3}"), ("\\boxed{3.45}", "2\\sqrt{3}"),
    ("\\boxed{\\sqrt{11}}", "2\\sqrt{3}"), ("\\boxed{3.47}", "3.46"), ("\\boxed{3.4}", "3.46"),
    ("\\boxed{3.5}", "3.46"), ("\\boxed{\\sqrt{13}}", "3.46"), ("\\boxed{0.44}", "\\frac{3}{7}"),
    ("\\boxed{12.8}", "12.9"), ("\\boxed{13}", "12.9"),
])
def test_no_choices_off_by_one_and_near_values_are_wrong(response, gold):
    assert _raw(response, gold) in NOT_CORRECT
    assert _raw(response, {"letter": None, "value": gold, "choices": None}) in NOT_CORRECT


@pytest.mark.parametrize("response,gold", [
    ("\\boxed{120}", "120"), ("\\boxed{120.0}", "120"), ("\\boxed{1,000}", "1000"), ("\\boxed{60^\\circ}", "60"),
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}"), ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}"), ("\\boxed{3.46}", "2\\sqrt{3}"),
    ("\\boxed{3.4641}", "2\\sqrt{3}"), ("\\boxed{3.46}", "3.46"), ("\\boxed{2\\sqrt{3}}", "3.46"),
    ("\\boxed{3.464}", "3.46"), ("\\boxed{12.94}", "12.9"), ("\\boxed{0.43}", "\\frac{3}{7}"),
])
def test_no_choices_right_values_stay_correct(response, gold):
    assert _raw(response, gold) is Verdict.CORRECT


# --- 2. with choices: a value picks the single nearest choice, unambiguously, and must be close to it ----------

G = {"letter": "B", "value": "120", "choices": ["119", "120", "121", "240"]}
R = {"letter": "A", "value": "3.46", "choices": ["3.46", "3.5", "4", "6"]}
S = {"letter": "B", "value": "2 \\sqrt { 3 }", "choices": ["3", "2 \\sqrt { 3 }", "3.5", "6"]}
T = {"letter": "C", "value": "10", "choices": ["9.9", "10.1", "10", "12"]}


@pytest.mark.parametrize("response,answer", [
    ("<answer>120.6</answer>", G), ("<answer>121</answer>", G), ("<answer>119.5</answer>", G),  # tie 119/120
    ("<answer>120.5</answer>", G), ("<answer>120.9</answer>", G), ("<answer>122</answer>", G),
    ("<answer>3.49</answer>", R), ("<answer>3.48</answer>", R), ("<answer>3.5</answer>", R),
    ("<answer>3.52</answer>", S), ("<answer>3.49</answer>", S), ("<answer>3.4820508</answer>", S),  # tie
    ("<answer>3.47</answer>", S), ("<answer>10.05</answer>", T), ("<answer>10.06</answer>", T),
    ("<answer>9.95</answer>", T), ("<answer>10.01</answer>", T), ("<answer>10.1</answer>", T),
])
def test_value_nearest_to_another_choice_or_tied_is_wrong(response, answer):
    assert _raw(response, answer) in NOT_CORRECT


@pytest.mark.parametrize("response,answer", [
    ("<answer>120</answer>", G), ("<answer>B</answer>", G), ("<answer>3.46</answer>", R),
    ("<answer>2\\sqrt{3}</answer>", R), ("<answer>3.464</answer>", R), ("<answer>2\\sqrt{3}</answer>", S),
    ("<answer>3.46</answer>", S), ("<answer>3.4641</answer>", S), ("<answer>10</answer>", T),
    ("<answer>10.00</answer>", T), ("<answer>C. 10</answer>", T),
])
def test_value_of_the_right_choice_stays_correct(response, answer):
    assert _raw(response, answer) is Verdict.CORRECT


# --- 3. hedges: a final answer naming several letters is no answer ------------------------------------------

@pytest.mark.parametrize("response", [
    "<answer>(A) (B) (C) (D)</answer>", "<answer>A. B. C. D.</answer>", "<answer>A) or B)</answer>",
    "<answer>B) or A)</answer>", "<answer>(B) or (C)</answer>", "<answer>(A) 3 (B) 2\\sqrt{3}</answer>",
    "\\boxed{(A)(B)(C)(D)}", "\\boxed{A. B.}", "The answer is (A) (B) (C) (D)", "Answer: A) or B)",
    "<answer>B or C</answer>", "<answer>A, B, C, D</answer>", "<answer>Option A or option B</answer>",
    "<answer>B: 2\\sqrt{3} (C) 4</answer>",
])
def test_hedged_letters_are_not_correct(response):
    for truth in (S, "A", "B", {"letter": "A", "value": "3", "choices": S["choices"]}):
        assert _raw(response, truth) in NOT_CORRECT, truth
    assert extract_choice(response) is None


@pytest.mark.parametrize("response", [
    "<answer>B</answer>", "<answer>(B)</answer>", "<answer>B. 2\\sqrt{3}</answer>", "<answer>(B) 2\\sqrt{3}</answer>",
    "<answer>B. B.</answer>", "<answer>(B) (B)</answer>",  # one letter, repeated
    "Not (A), maybe (C)... no: (A) 3 is too small, (C) 3.5 too big. \\boxed{B}",  # others only in the reasoning
    "A) 3, B) 2√3, C) 3.5 — so the answer is B.", "<answer>Option B</answer>",
])
def test_single_letter_answers_stay_correct(response):
    assert _raw(response, S) is Verdict.CORRECT


# --- 4. words after a value (found by tests/test_verifier_fuzz.py, geometry3k-1.2): only unit words are dropped ----

@pytest.mark.parametrize("words", ["is wrong", "or sixteen", "or more", "or less", "not", "maybe", "and twenty",
                                   "wrong", "is not the answer", "no"])
def test_words_after_a_value_are_not_units(words):
    g = {"letter": "B", "value": "15", "choices": ["12", "15", "18", "20"]}
    for truth in (g, "15"):
        assert _raw(f"<answer>15 {words}</answer>", truth) in NOT_CORRECT, (words, truth)


@pytest.mark.parametrize("unit", ["cm", "units", "degrees", "cm^2", "in.", "square units", "sq. ft", "ft^{2}", "inches",
                                  "m", "\\text{ mm}"])
def test_unit_words_are_dropped(unit):
    assert _raw(f"<answer>15 {unit}</answer>", {"letter": "B", "value": "15", "choices": ["12", "15", "18", "20"]}) \
        is Verdict.CORRECT
    assert _raw(f"<answer>x = 15 {unit}</answer>", "15") is Verdict.CORRECT


# --- fuzz over real problems --------------------------------------------------------------------------------

def _problems(source: str):
    """The real val split where the dataset is present (conftest's geometry3k_source), else the bundled train split."""
    if Path(source) != FIXTURES:
        return task.load(split="val", source=source), "val"
    return task.load(split="train", source=source), "fixtures"


def _wrong_responses(a):
    """Constructed-wrong final answers to a problem with choices, each a str (the answer goes in <answer>)."""
    letters = "ABCD"[:len(a["choices"])]
    right = letters.index(a["letter"])
    nums = [parse_number(c) for c in a["choices"]]
    v = nums[right]
    out = []
    for other in letters:
        if other != a["letter"]:
            out += [f"({a['letter']}) ({other})", f"{a['letter']}. {other}.", f"{other}) or {a['letter']})",
                    f"({other}) {a['choices'][letters.index(other)]} ({a['letter']}) {a['value']}"]
    out.append(" ".join(f"({x})" for x in letters))
    out.append(" ".join(f"{x}." for x in letters))
    if v is None:
        return out
    if v == int(v) and abs(v) < 1e9:
        out += [str(int(v) + 1), str(int(v) - 1)]
    for j, w in enumerate(nums):
        if j == right or w is None or abs(w - v) <= 1e-9 * max(1.0, abs(v)):
            continue
        out += [repr(w + 0.25 * (v - w)), repr(w + 0.45 * (v - w)), repr((v + w) / 2)]  # nearer j, or a tie
    return out


def test_fuzz_real_problems_no_false_positive(geometry3k_source):
    t0 = time.perf_counter()
    problems, origin = _problems(geometry3k_source)
    checked, false_positives = 0, []
    for p in problems:
        a = p.answer
        assert _raw(f"<answer>{a['letter']}</answer>", a) is Verdict.CORRECT, p.uid
        assert _raw(f"<answer>{a['value']}</answer>", a) is Verdict.CORRECT, p.uid
        assert _raw(f"<answer>({a['letter']}) {a['value']}</answer>", a) is Verdict.CORRECT, p.uid
        for r in _wrong_responses(a):
            for response in (f"<answer>{r}</answer>", f"\\boxed{{{r}}}"):
                checked += 1
                if _raw(response, a) is Verdict.CORRECT:
                    false_positives.append((p.uid, response))
        # the same problem without its choices (value only): off-by-one / 0.5 % off an exact gold is wrong
        value_only = {"letter": None, "value": a["value"], "choices": None}
        v = parse_number(a["value"])
        assert _raw(f"\\boxed{{{a['value']}}}", value_only) is Verdict.CORRECT, p.uid
        if v is not None and v != 0 and choice._places(a["value"]) is None:
            wrong = [repr(v * 1.005), repr(v * 0.995)]
            if v == int(v) and abs(v) < 1e9:
                wrong += [str(int(v) + 1), str(int(v) - 1)]
            for r in wrong:
                checked += 1
                if _raw(f"\\boxed{{{r}}}", value_only) is Verdict.CORRECT:
                    false_positives.append((p.uid, "value-only", r))
    elapsed = time.perf_counter() - t0
    print(f"\nchoice fuzz ({origin}): {len(problems)} problems, {checked} wrong answers in {elapsed:.1f}s")
    assert not false_positives, false_positives[:20]
    assert checked > 0 and elapsed < 60
