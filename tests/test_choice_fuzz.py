"""Seeded fuzz of the choice verifier (Geometry3K) over hostile families found in review, judged by an oracle of exact
fractions that shares no code with the verifier.

Problems have four choices of known exact value, written as Geometry3K writes them: integers, "- 3", decimals,
"\\frac { 3 } { 7 }" and mixed numbers "4 \\frac { 4 } { 11 }" (with the data set's misreading, the product 4 * 4/11,
as their precise_values, as in test problem 2885: the text must win). Responses, each with the exact value it
states, by family:
  mixed     a choice's value (or the misread product, or a near value) as a mixed number "2\\frac{1}{2}", "2 1/2",
            an improper fraction, an explicit product "4 \\cdot \\frac{4}{11}", or a rounded decimal;
  chain     "a = b", "x = a = b", "a \\approx b": CORRECT only if every side is right;
  nested    boxes in a box, "\\boxed{\\boxed{B} or \\boxed{C}}" (a hedge: never CORRECT), and single ones;
  degrees   a rounded decimal with a degree sign, which keeps the rounding tolerance of the plain decimal.
Each response is judged against the full ground truth, the letter alone or the value alone. The oracle applies the
documented rule (choice.py's TOLERANCE, nearest single choice) with exact Fractions and a small margin: a case too
near the edge of the rule for floats is left out.

Asserted: 0 exceptions (the verifier is called without its last-resort guard), 0 false positives, every control
accepted, each call within the verifier's TIME_BUDGET of CPU, and the same verdicts when the batch is shuffled.
"""
import gc
import random
import time
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

from bapo_vl.plugins import load_folder
from bapo_vl.problem import Verdict
from bapo_vl.verifiers import choice

SEED = 26
N = 8000
LETTERS = "ABCD"
EDGE = Fraction(1, 10**6)  # relative margin: nearer the edge of the rule than this, a case is left out
task = load_folder(Path(__file__).resolve().parents[1] / "tasks" / "geometry3k").module


class Choice(NamedTuple):
    text: str
    value: Fraction
    places: int | None  # decimal places of a decimal choice (a rounded value), else None
    precise: float  # what the data set would store: the misread product for a mixed number


class Case(NamedTuple):
    response: str
    answer: object
    label: str  # "wrong": CORRECT is a false positive; "right": a control that must be CORRECT
    family: str


# --- problems -------------------------------------------------------------------------------------------------

def _mixed_parts(v: Fraction) -> tuple[int, int, int] | None:
    """(whole, numerator, denominator) of a positive non-integer v > 1 as a mixed number."""
    if v <= 1 or v.denominator == 1:
        return None
    whole = v.numerator // v.denominator
    return whole, v.numerator - whole * v.denominator, v.denominator


def _choice(rng: random.Random) -> Choice:
    kind = rng.randrange(5)
    if kind == 0:
        n = rng.randint(1, 200)
        return Choice(str(n), Fraction(n), None, float(n))
    if kind == 1:
        n = rng.randint(1, 12)
        return Choice(f"- {n}", Fraction(-n), None, float(-n))
    if kind == 2:
        k = rng.choice([1, 2])
        v = Fraction(rng.randint(11, 9999), 10**k)
        return Choice(f"{v.numerator / v.denominator:.{k}f}", v, k, float(v))
    if kind == 3:
        p, q = rng.randint(1, 30), rng.randint(2, 13)
        return Choice(f"\\frac {{ {p} }} {{ {q} }}", Fraction(p, q), None, p / q)
    whole, q = rng.randint(1, 15), rng.randint(2, 12)
    p = rng.randint(1, q - 1)
    return Choice(f"{whole} \\frac {{ {p} }} {{ {q} }}", whole + Fraction(p, q), None, whole * p / q)


def _problem(rng: random.Random) -> tuple[list[Choice], int]:
    """Four choices of distinct values and the right one's index; often a mixed number beside its misreading."""
    while True:
        choices = [_choice(rng) for _ in range(4)]
        if rng.random() < 0.4:  # "2 \frac { 1 } { 2 }" and "1" among the choices: the misreading picks a wrong one
            whole, q = rng.randint(2, 9), rng.randint(2, 9)
            p = rng.randint(1, q - 1)
            product = Fraction(whole * p, q)
            choices[0] = Choice(f"{whole} \\frac {{ {p} }} {{ {q} }}", whole + Fraction(p, q), None, float(product))
            text = str(product) if product.denominator == 1 else \
                f"\\frac {{ {product.numerator} }} {{ {product.denominator} }}"
            choices[1] = Choice(text, product, None, float(product))
            rng.shuffle(choices)
        values = [c.value for c in choices]
        if len(set(values)) == 4:
            return choices, rng.randrange(4)


def _truths(rng: random.Random, choices: list[Choice], right: int) -> list[tuple[str, object]]:
    full = {"letter": LETTERS[right], "value": choices[right].text, "choices": [c.text for c in choices],
            "precise_values": [c.precise for c in choices]}
    return [("full", full), ("letter", LETTERS[right]), ("value", choices[right].text)]


# --- the oracle -----------------------------------------------------------------------------------------------

def _close(x: Fraction, x_places: int | None, gold: Choice) -> bool | None:
    """The documented TOLERANCE with exact Fractions: True, False, or None (too near the edge to say)."""
    tol = Fraction(0)
    if gold.places is not None:
        tol = max(tol, Fraction(1, 2 * 10**gold.places))
    if x_places is not None and x_places >= 2:
        tol = max(tol, Fraction(1, 2 * 10**x_places))
    d, margin = abs(x - gold.value), EDGE * max(1, abs(gold.value))
    if d <= tol - margin or (tol == 0 and d == 0):
        return True
    if d > tol + margin:
        return False
    return None


def _side_right(x: Fraction, x_places: int | None, choices: list[Choice], right: int, known: bool) -> bool | None:
    """Whether a stated value x picks the right choice: close to it and no other choice as near (None: unsure)."""
    close = _close(x, x_places, choices[right])
    if close is not True or not known:
        return close
    d = abs(x - choices[right].value)
    margin = EDGE * max(1, abs(choices[right].value))
    others = [abs(x - c.value) for i, c in enumerate(choices) if i != right]
    if min(others) <= d - margin or (d == 0 and min(others) == 0):
        return False
    if min(others) <= d + margin:
        return None
    return True


def _all(verdicts: list[bool | None]) -> bool | None:
    if any(v is False for v in verdicts):
        return False
    return None if any(v is None for v in verdicts) else True


# --- the families ---------------------------------------------------------------------------------------------

class Stated(NamedTuple):
    text: str
    value: Fraction
    places: int | None


def _decimal(rng: random.Random, v: Fraction) -> Stated:
    k = rng.randint(1, 4)
    text = f"{v.numerator / v.denominator:.{k}f}"
    return Stated(text, Fraction(text), k)


def _written(rng: random.Random, v: Fraction) -> Stated:
    """v in a form chosen at random; mixed-number forms where v has one (and its sign carried in front)."""
    sign, a = ("-" if v < 0 else ""), abs(v)
    parts = _mixed_parts(a)
    forms = [lambda: _decimal(rng, v)]
    if a.denominator == 1:
        forms.append(lambda: Stated(f"{sign}{a.numerator}", v, None))
    else:
        forms.append(lambda: Stated(f"{sign}\\frac{{{a.numerator}}}{{{a.denominator}}}", v, None))
    if parts:
        w, p, q = parts
        forms += [lambda: Stated(f"{sign}{w}\\frac{{{p}}}{{{q}}}", v, None),
                  lambda: Stated(f"{sign}{w} \\frac {{ {p} }} {{ {q} }}", v, None),
                  lambda: Stated(f"{sign}{w}\\dfrac{{{p}}}{{{q}}}", v, None),
                  lambda: Stated(f"{sign}{w} {p}/{q}", v, None),
                  lambda: Stated(f"{sign}{w} \\cdot \\frac{{{p}}}{{{q}}}", (-1 if sign else 1) * Fraction(w * p, q),
                                 None)]
    return rng.choice(forms)()


def _target(rng: random.Random, choices: list[Choice], right: int) -> Fraction:
    """A value to state: a choice's, a mixed choice's misread product, or one near the right value."""
    r = choices[right].value
    kind = rng.randrange(6)
    if kind <= 1:
        return r
    if kind == 2:
        return rng.choice(choices).value
    if kind == 3:
        mixed = [c for c in choices if c.precise != float(c.value)]
        return Fraction(rng.choice(mixed).precise) if mixed else r + 1
    if kind == 4:
        return r + rng.choice([1, -1]) * Fraction(rng.choice([1, 5, 10, 50]), 1000)
    return r * Fraction(rng.choice([9, 11, 2, 10]), 10)


def _dress(rng: random.Random, text: str) -> str:
    return rng.choice(["{}", "x = {}", "{} cm", "m \\angle B = {}", "S R = {}"]).format(text)


def _envelope(rng: random.Random, a: str) -> str:
    return rng.choice(["<answer>{}</answer>", "\\boxed{{{}}}", "The answer is {}.", "Answer: {}",
                       "Let me think. <answer>{}</answer>"]).format(a)


def _cases(rng: random.Random):
    """Endless lists of cases, one problem at a time."""
    while True:
        choices, right = _problem(rng)
        out = []
        for how, truth in _truths(rng, choices, right):
            known = how == "full"  # the choices are known (else the value alone, or the letter alone)

            def add(response: str, verdict: bool | None, family: str) -> None:
                if how == "letter" and family != "nested-letter":  # a letter alone cannot judge a value
                    verdict = False if verdict is not None else None
                if verdict is not None:
                    out.append(Case(response, truth, "right" if verdict else "wrong", family))

            # mixed numbers (and the other written forms) of a target value
            s = _written(rng, _target(rng, choices, right))
            add(_envelope(rng, _dress(rng, s.text)), _side_right(s.value, s.places, choices, right, known), "mixed")

            # a chain of values: every side must be right
            sides = [_written(rng, _target(rng, choices, right)) for _ in range(rng.choice([2, 2, 3]))]
            relation = rng.choice([" = ", " = ", " \\approx ", " ≈ "])
            chain = relation.join(x.text for x in sides)
            if rng.random() < 0.5:
                chain = f"x = {chain}"
            add(_envelope(rng, chain), _all([_side_right(x.value, x.places, choices, right, known) for x in sides]),
                "chain")

            # boxes in a box: two different letters or values are a hedge; one box in a box is that box
            others = [i for i in range(4) if i != right]
            a, b = rng.sample([right, rng.choice(others)], 2)
            glue = rng.choice([" or ", " \\text{ or } ", ", ", " and ", " = "])  # not " / ": 6 / 2 is 3
            if rng.random() < 0.5:
                glue = rng.choice([glue, " / "])
                add(f"\\boxed{{\\boxed{{{LETTERS[a]}}}{glue}\\boxed{{{LETTERS[b]}}}}}", False, "nested-letter")
                add(f"\\boxed{{\\boxed{{{LETTERS[right]}}}}}", how != "value", "nested-letter")
            else:
                x, y = _written(rng, choices[a].value), _written(rng, choices[b].value)  # a product may equal...
                sides = _all([_side_right(z.value, z.places, choices, right, known) for z in (x, y)])
                hedge = sides if glue == " = " else False if x.value != y.value else None  # "5 or 5": left out
                add(f"\\boxed{{\\boxed{{{x.text}}}{glue}\\boxed{{{y.text}}}}}", hedge, "nested-value")
                x = _written(rng, rng.choice(choices).value)
                add(f"\\boxed{{x = \\boxed{{{x.text}}}}}", _side_right(x.value, x.places, choices, right, known),
                    "nested-value")

            # a rounded decimal with a degree sign: the plain decimal's tolerance
            d = _decimal(rng, _target(rng, choices, right))
            degree = rng.choice(["^\\circ", "°", "^{\\circ}", " ^ { \\circ }", "\\degree"])
            add(_envelope(rng, f"{d.text}{degree}"), _side_right(d.value, d.places, choices, right, known), "degrees")
        yield out


def _take(rng: random.Random, n: int) -> list[Case]:
    cases = []
    for batch in _cases(rng):
        cases += batch
        if len(cases) >= n:
            return cases[:n]


# --- the test -------------------------------------------------------------------------------------------------

def test_choice_fuzz_mixed_numbers_chains_nested_boxes_degrees():
    cases = _take(random.Random(SEED), N)
    counts, exceptions, false_positives, rejected, overruns = Counter(), [], [], [], []
    verdicts = []
    t0 = time.perf_counter()
    for case in cases:
        counts[(case.family, case.label)] += 1
        gc.disable()
        c0 = time.thread_time()
        try:
            verdict = choice._verify(case.response, case.answer, choice.LETTERS)
        except Exception as e:  # noqa: BLE001 - counted
            verdict = f"{type(e).__name__}: {e}"
            exceptions.append((case.response, case.answer, verdict))
        finally:
            cpu = time.thread_time() - c0
            gc.enable()
        verdicts.append(verdict)
        if cpu > choice.TIME_BUDGET:
            overruns.append((case.response, round(cpu, 4)))
        if verdict is Verdict.CORRECT and case.label == "wrong":
            false_positives.append((case.family, case.response, case.answer))
        elif verdict is not Verdict.CORRECT and case.label == "right":
            rejected.append((case.family, case.response, case.answer, verdict))
    elapsed = time.perf_counter() - t0
    print(f"\nchoice fuzz (hostile families): {len(cases)} cases in {elapsed:.2f} s: {len(exceptions)} exceptions, "
          f"{len(false_positives)} false positives, {len(rejected)} controls rejected, {len(overruns)} overruns; "
          f"{dict(sorted(counts.items()))}")
    assert not exceptions, exceptions[:10]
    assert not false_positives, false_positives[:10]
    assert not rejected, rejected[:10]
    assert not overruns, overruns[:10]
    for family in ("mixed", "chain", "nested-letter", "nested-value", "degrees"):  # not vacuous
        assert counts[(family, "wrong")] >= 100 and counts[(family, "right")] >= 50, family

    # the same verdicts whatever the rest of the batch: the task's verify over a shuffled batch
    order = list(range(len(cases)))
    random.Random(SEED + 1).shuffle(order)
    shuffled = {i: task.verify(cases[i].response, cases[i].answer) for i in order}
    assert [shuffled[i] for i in range(len(cases))] == verdicts
