"""Soundness of the choice verifier (Geometry3K): constructed-wrong answers must not be CORRECT.

Three false-positive patterns found by fuzzing, each with a regression test; the cases found in review (mixed numbers,
relation chains, boxes in boxes, decimals with a degree sign); then a fuzz test over real problems (Geometry3K's val
split where the dataset is present, else the bundled fixtures): 0 false positives, 0 exceptions. The seeded fuzz of
these families against exact fractions is tests/test_choice_fuzz.py.
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


# --- 5. mixed numbers, relation chains, nested boxes, decimals with a degree sign ------------------

# test problem 2885 as the data set has it: its precise_value reads the mixed numbers as products (4 * 4/11)
P2885 = {"letter": "B", "value": "4 \\frac { 4 } { 11 }",
         "choices": ["1 \\frac { 5 } { 6 }", "4 \\frac { 4 } { 11 }", "3", "14 \\frac { 2 } { 3 }"],
         "precise_values": [0.8333333333333334, 1.4545454545454546, 3.0, 9.333333333333332]}


def test_mixed_number_choices_are_read_from_their_text_not_the_precise_values():
    assert choice.choice_values(P2885["choices"], P2885["precise_values"]) == \
        pytest.approx([11 / 6, 48 / 11, 3, 44 / 3], rel=1e-12)
    value_only = P2885["value"]
    for r in ("\\boxed{\\frac{48}{11}}", "<answer>4\\frac{4}{11}</answer>", "<answer>4 4/11</answer>",
              "<answer>4.36</answer>", "<answer>SR = \\dfrac{48}{11}</answer>", "<answer>B</answer>"):
        assert _raw(r, P2885) is Verdict.CORRECT, r
        if "B<" not in r:
            assert _raw(r, value_only) is Verdict.CORRECT, r
    for r in ("\\boxed{\\frac{16}{11}}", "<answer>1.45</answer>", "<answer>1.4545</answer>", "\\boxed{\\frac{5}{6}}",
              "\\boxed{\\frac{28}{3}}", "<answer>9.33</answer>", "<answer>4 \\cdot \\frac{4}{11}</answer>"):
        assert _raw(r, P2885) in NOT_CORRECT, r
        assert _raw(r, value_only) in NOT_CORRECT, r


@pytest.mark.parametrize("text,value", [
    ("2\\frac{1}{2}", 2.5), ("7\\frac{1}{2}", 7.5), ("2 1/2", 2.5), ("-2\\frac{1}{2}", -2.5), ("- 2 1/2", -2.5),
    ("3\\dfrac{3}{4}", 3.75), ("4 \\frac { 4 } { 11 }", 48 / 11), ("(2\\frac{1}{2})", 2.5), ("1 + 2\\frac{1}{2}", 3.5),
    ("7\\frac{1}{2}^\\circ", 7.5), ("2\\frac{1}{2}\\pi", 2.5 * 3.141592653589793),
    ("2\\frac{\\sqrt{3}}{2}", 3 ** 0.5), ("2 \\cdot \\frac{1}{2}", 1.0), ("2 \\sqrt { 3 }", 2 * 3 ** 0.5),  # products
    ("2\\frac{3}{2}", None), ("\\sqrt 2 \\frac{1}{2}", None), ("10^2\\frac{1}{2}", None),  # unclear: no number
    ("1.5\\frac{1}{2}", None), ("2\\frac{1}{0}", None),
])
def test_mixed_numbers_are_sums(text, value):
    assert parse_number(text) == (None if value is None else pytest.approx(value, rel=1e-12))


def test_mixed_numbers_in_responses():
    halves = {"letter": "B", "value": "2.5", "choices": ["1", "2.5", "4", "7.5"]}
    for r in ("\\boxed{2\\frac{1}{2}}", "<answer>2 1/2</answer>", "<answer>x = 2\\frac{1}{2} cm</answer>"):
        assert _raw(r, halves) is Verdict.CORRECT, r
        assert _raw(r, {**halves, "letter": "A", "value": "1"}) is Verdict.WRONG, r  # not the product 2 * 1/2
        assert _raw(r, "2.5") is Verdict.CORRECT and _raw(r, "1") is Verdict.WRONG, r
    assert _raw("\\boxed{7\\frac{1}{2}}", "7.5") is Verdict.CORRECT
    assert _raw("\\boxed{7\\frac{1}{2}}", {**halves, "letter": "D", "value": "7.5"}) is Verdict.CORRECT
    assert _raw("\\boxed{7\\frac{1}{2}}", "3.5") is Verdict.WRONG


CHAIN = {"letter": "B", "value": "10", "choices": ["8", "10", "12", "14"]}


@pytest.mark.parametrize("response", [
    "<answer>12 = 10</answer>", "\\boxed{12 = 10}", "<answer>10 = 12</answer>", "<answer>x = 12 = 10</answer>",
    "<answer>12 \\approx 10</answer>", "<answer>12 ≈ 10</answer>", "<answer>x = 10 = 12 cm</answer>",
    "<answer>12 cm = 10 cm</answer>", "<answer>x = 10 \\approx 9.5</answer>", "Answer: 12 = 10",
    "<answer>x != 10</answer>", "<answer>x <= 10</answer>", "<answer>x >= 10</answer>",
    "<answer>x == 12 == 10</answer>",
])
def test_a_chain_of_values_counts_only_if_every_side_is_right(response):
    for truth in (CHAIN, "10"):
        assert _raw(response, truth) in NOT_CORRECT, truth


@pytest.mark.parametrize("response", [
    "<answer>x = 10</answer>", "<answer>m \\angle B = 10</answer>", "<answer>x = 10 = 10.0</answer>",
    "<answer>x = \\frac{20}{2} = 10</answer>", "<answer>x = 5 + 5 = 10 cm</answer>", "<answer>x \\approx 10</answer>",
])
def test_chains_that_are_right_in_every_side_stay_correct(response):
    for truth in (CHAIN, "10"):
        assert _raw(response, truth) is Verdict.CORRECT, truth
    assert _raw("<answer>x = 2\\sqrt{3} \\approx 3.46</answer>", S) is Verdict.CORRECT
    assert _raw("<answer>x = 2\\sqrt{3} \\approx 3.5</answer>", S) is Verdict.WRONG  # 3.5 is choice C


NESTED = {"letter": "C", "value": "10", "choices": ["8", "9", "10", "14"]}


@pytest.mark.parametrize("response", [
    "\\boxed{\\boxed{B} or \\boxed{C}}", "\\boxed{\\boxed{C} or \\boxed{B}}",
    "\\boxed{\\boxed{B} \\text{ or } \\boxed{C}}",
    "\\boxed{\\boxed{B}, \\boxed{C}}", "\\fbox{\\boxed{B} / \\boxed{C}}", "\\boxed{B or \\boxed{C}}",
    "\\boxed{either \\boxed{B} or \\boxed{C}}", "\\boxed{\\boxed{9} or \\boxed{10}}",
    "\\boxed{\\boxed{9} = \\boxed{10}}",
    "Final: \\boxed{\\text{(B) or } \\boxed{C}}", "\\boxed{1} \\boxed{\\boxed{B} or \\boxed{C}}",
])
def test_a_box_of_boxes_is_read_whole(response):
    for truth in (NESTED, "C", "10"):
        assert _raw(response, truth) in NOT_CORRECT, truth
    assert extract_choice(response) is None


@pytest.mark.parametrize("response", [
    "\\boxed{\\boxed{C}}", "\\boxed{x = \\boxed{10}}", "\\boxed{B} no, wait: \\boxed{C}",  # the last box counts
    "\\boxed{C} and then \\boxed{9",  # a box left open is no box (a response cut off in its box)
])
def test_single_nested_or_last_boxes_stay_correct(response):
    assert _raw(response, NESTED) is Verdict.CORRECT


@pytest.mark.parametrize("number", ["9.80", "9.798", "9.7980", "9.8", "9.79", "9.81", "9.8000", "10"])
@pytest.mark.parametrize("degree", ["^\\circ", "°", "^{\\circ}", " ^ { \\circ }", "\\degree"])
def test_a_degree_sign_keeps_the_rounding_tolerance_of_a_decimal(number, degree):
    four_root_six = {"letter": "D", "value": "4 \\sqrt { 6 }",  # 9.7980 (test 2589's choices)
                     "choices": ["2 \\sqrt { 3 }", "2 \\sqrt { 6 }", "4 \\sqrt { 3 }", "4 \\sqrt { 6 }"]}
    for truth in (four_root_six, "4 \\sqrt { 6 }", "9.80"):
        plain = _raw(f"<answer>{number}</answer>", truth)
        assert _raw(f"<answer>{number}{degree}</answer>", truth) is plain, truth
        assert plain is (Verdict.CORRECT if number in ("9.80", "9.798", "9.7980") or (
            truth == "9.80" and number in ("9.8", "9.8000")) else Verdict.WRONG), truth


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

