"""Math fuzz, the families of hostile answers found in review: prose negations and self-corrections, unicode roots, numerals with
subscripts, mixed numbers, named tuples, currency, degrees inside trig, complex forms, decimal golds with rational
responses, nested boxes. Each case is labelled by an oracle that shares no code with the verifier: exact Fractions,
and sympy / mpmath at 50 digits for closed forms. The verifier's in-process part is called without its guard
(an exception is counted, not hidden); what needs sympy goes through verify_batch, the API the trainer uses.
Asserted: no exception, no false positive, no TIMEOUT, and most right cases accepted (so the fuzz is not vacuous)."""
import random
import time
from collections import Counter
from fractions import Fraction
from typing import NamedTuple

import sympy as sp

from bapo_vl.problem import Verdict
from bapo_vl.verifiers import math as mv

SEED = 26
REL_TOL = Fraction(1, 10**6)  # the documented tolerance where the gold is a decimal


class Case(NamedTuple):
    response: str
    gold: str
    label: str  # "wrong": CORRECT is a false positive; "right": the oracle says equal
    family: str


# ---------------------------------------------------------------- oracle helpers (no verifier code)

def tex(v: Fraction) -> str:
    if v.denominator == 1:
        return str(v.numerator)
    return ("-" if v < 0 else "") + f"\\frac{{{abs(v.numerator)}}}{{{v.denominator}}}"


def rational(rng: random.Random) -> Fraction:
    if rng.random() < 0.6:
        return Fraction(rng.randint(-30, 300))
    q = rng.randint(2, 40)
    return Fraction(rng.randint(-5 * q, 20 * q), q)


def other(rng: random.Random, g: Fraction) -> Fraction:
    return g + rng.choice([1, -1, 2, 10, Fraction(1, 2), Fraction(-1, 3)])


def label(equal: bool) -> str:
    return "right" if equal else "wrong"


def numeric_equal(a: sp.Expr, b: sp.Expr) -> bool:
    """Closed forms equal to 50 digits (the golds below differ from the responses by far more, or not at all)."""
    d = complex(sp.N(a - b, 50))
    return abs(d) < 1e-40


def box(x: str) -> str:
    return f"So the final answer is $\\boxed{{{x}}}$."


# ---------------------------------------------------------------- families

def negation(rng):
    g = rational(rng)
    w = other(rng, g)
    G, Wt = tex(g), tex(w)
    wrong = [
        f"The answer is not ${G}$.", f"The answer isn't ${G}$.", f"The answer is not $\\boxed{{{G}}}$.",
        f"The answer is at least ${G}$.", f"The answer is at most $\\boxed{{{G}}}$.",
        f"The answer is anything but ${G}$.", f"The answer is ${G}$ or more.", f"The answer is more than ${G}$.",
        f"The answer is ${G}$? No.", f"Answer: ${G}$ is incorrect.", f"Answer: ${G}$ is incorrect; the correct "
        f"answer is ${Wt}$.", f"The answer is ${G}$? No. The answer is ${Wt}$.", f"$x \\neq \\boxed{{{G}}}$",
        f"\\boxed{{{G}}} is wrong.", f"The answer is $\\boxed{{{G}}}$. Wait, that's wrong.",
        f"The answer is never ${G}$.", f"The answer is other than ${G}$.", f"The answer cannot be $\\boxed{{{G}}}$.",
        f"Answer: not {G}", f"The answer is $x > {G}$.", f"<answer>The answer is not ${G}$</answer>",
        f"The final answer is ${G}$... no, it is ${Wt}$.", f"The answer is approximately ${G}$.",
        f"The answer is $\\boxed{{{G}}}$? No.", f"The answer: ${G}$ is wrong, it is ${Wt}$.",
        f"The answer is $\\boxed{{{Wt}}}$ or $\\boxed{{{G}}}$.", f"\\boxed{{{Wt}}} or \\boxed{{{G}}}",
    ]
    right = [f"Answer: ${Wt}$ is incorrect; the correct answer is ${G}$.",
             f"The answer is ${Wt}$? No. The answer is ${G}$.", f"The answer is ${G}$, not ${Wt}$.",
             f"Since no other value works, the answer is $\\boxed{{{G}}}$.",
             f"We first guessed ${Wt}$, which is wrong.\n\nThe answer is $\\boxed{{{G}}}$."]
    out = [Case(rng.choice(wrong), G, "wrong", "negation")]
    if rng.random() < 0.3:
        out.append(Case(rng.choice(right), G, "right", "negation"))
    return out


def unicode_root(rng):
    k = rng.choice([2, 2, 2, 3])
    n = rng.randint(2, 60) ** k if rng.random() < 0.6 else rng.randint(2, 5000)
    sign = {2: "√", 3: "∛"}[k]
    true = sp.root(sp.Integer(n), k)
    s = str(n)
    misread = sp.root(int(s[0]), k) * int(s[1:] or 1)  # the root of the first digit times the rest: √196 as 96
    value = rng.choice([true, misread, sp.Integer(n), true + 1])
    gold = sp.latex(value)
    response = rng.choice([box(f"{sign}{n}"), f"The answer is ${sign}{n}$.", f"Answer: {sign}{n}"])
    return [Case(response, gold, label(sp.simplify(true - value) == 0), "unicode-root")]


def subscript(rng):
    digits = str(rng.randint(10, 999))
    base = rng.choice([2, 5, 8, 10, 12, 16])
    sub = rng.choice([str(base), f"{{{base}}}", f"{{({base})}}", f"{{{digits}+0}}", f"{{{base}-0}}"])
    value = int(digits, base) if sub.strip("{}()") == str(base) and all(int(c) < base for c in digits) else None
    response = box(rng.choice([f"{digits}_{sub}", f"{digits}_{{{sub.strip('{}')}}}", f"({digits})_{sub}"]))
    gold = rng.choice([digits, str(value) if value is not None else digits, str(int(digits) + 1)])
    return [Case(response, gold, label(value is not None and value == int(gold)), "subscript")]


def mixed_number(rng):
    whole, den = rng.randint(1, 20), rng.randint(2, 12)
    num = rng.randint(1, den - 1)
    neg = rng.random() < 0.2
    v = (whole + Fraction(num, den)) * (-1 if neg else 1)
    frac = rng.choice(["\\frac", "\\dfrac", "\\tfrac"])
    response = box(f"{'-' if neg else ''}{whole}{frac}{{{num}}}{{{den}}}")
    product = whole * Fraction(num, den) * (-1 if neg else 1)
    g = rng.choice([v, product, v + 1, v - Fraction(1, den)])
    gold = rng.choice([tex(g), str(float(g))]) if g.denominator in (2, 4, 5, 8, 10) else tex(g)
    return [Case(response, gold, label(Fraction(gold) == v if "." in gold else g == v), "mixed-number")]


def named_tuple(rng):
    n = rng.choice([2, 2, 3])
    vals = [rational(rng) for _ in range(n)]
    names = ["x", "y", "z"][:n] if rng.random() < 0.7 else ["a", "b", "c"][:n]
    gold_vals = rng.choice([vals, vals[::-1], [other(rng, vals[0])] + vals[1:], vals[:-1] + [other(rng, vals[-1])]])
    tup = ", ".join(map(tex, vals))
    response = box(rng.choice([f"({','.join(names)})=({tup})", f"({', '.join(names)}) = \\left({tup}\\right)",
                               f"({','.join(names)})=({tup})=({', '.join(map(tex, gold_vals))})"]))
    gold = f"({', '.join(map(tex, gold_vals))})"
    chain_ok = response.count("=") < 2 or gold_vals == vals
    return [Case(response, gold, label(gold_vals == vals and chain_ok), "named-tuple")]


def currency(rng):
    cents = rng.randint(1, 10**6) if rng.random() < 0.5 else rng.randint(1, 5000) * 100
    v = Fraction(cents, 100)
    amount = f"{cents // 100}.{cents % 100:02d}" if cents % 100 or rng.random() < 0.3 else str(cents // 100)
    if cents % 100 == 0 and cents >= 100_000 and rng.random() < 0.5:
        amount = f"{cents // 100:,}"
    response = rng.choice([f"The answer is $\\${amount}$.", box(f"\\${amount}"), f"Answer: \\${amount}",
                           f"The answer is $\\${amount}$ or $\\$1$.", f"The answer is not $\\${amount}$."])
    g = rng.choice([v, v + 1, v / 10])
    gold = str(g.numerator) if g.denominator == 1 else f"{float(g):.2f}" if g.denominator in (2, 4, 5, 10, 20, 25, 50,
                                                                                             100) else tex(g)
    gold_value = Fraction(gold) if "." in gold or gold.isdigit() else g
    hedged = " or " in response or " not " in response
    return [Case(response, gold, label(not hedged and gold_value == v), "currency")]


ANGLES = [0, 15, 30, 36, 45, 60, 72, 90, 120, 135, 150, 180, 210, 225, 240, 270, 300, 315, 330]


def degree_trig(rng):
    f = rng.choice(["sin", "cos", "tan"])
    k = rng.choice([a for a in ANGLES if not (f == "tan" and a % 180 == 90)])
    fn = getattr(sp, f)
    true = fn(sp.pi * k / 180)
    k2 = rng.choice([a for a in ANGLES if not (f == "tan" and a % 180 == 90)])
    value = rng.choice([true, fn(sp.pi * k2 / 180), -true, true + 1])
    response = box(rng.choice([f"\\{f} {k}^\\circ", f"\\{f}({k}^{{\\circ}})", f"\\{f} {k}°"]))
    return [Case(response, sp.latex(sp.nsimplify(value)), label(numeric_equal(true, value)), "degree-trig")]


def complex_form(rng):
    n = rng.choice([1, 2, 3, 4, 6])
    k = rng.randrange(1, 2 * n)
    angle = sp.pi * k / n
    true = sp.expand_complex(sp.exp(sp.I * angle))
    a = sp.latex(angle).replace(" ", "")
    response = box(rng.choice([f"e^{{i{a}}}", f"e^{{{a} i}}", f"\\cos{{{a}}}+i\\sin{{{a}}}",
                               f"\\cos\\left({a}\\right) + i \\sin\\left({a}\\right)", f"\\cos{{{a}}}-i\\sin{{{a}}}"]))
    if "-i" in response:
        true = sp.conjugate(true)
    value = rng.choice([true, sp.conjugate(true), -true, sp.expand_complex(sp.exp(sp.I * sp.pi * (k + 1) / n))])
    gold = sp.latex(value).replace("i", "i ")
    return [Case(response, gold, label(numeric_equal(true, value)), "complex-form")]


def decimal_gold(rng):
    places = rng.randint(3, 7)
    x = Fraction(rng.randint(1, 10**9), rng.randint(1, 10**6)) if rng.random() < 0.7 else Fraction(
        round(rng.random() * 10**10), 10**9)
    gold_value = Fraction(round(x * 10**places), 10**places)
    if gold_value == 0:
        gold_value = Fraction(1, 10**places)
    gold = f"{float(gold_value):.{places}f}"
    gold_value = Fraction(gold)
    extra = rng.randint(1, 4)
    candidates = [Fraction(round(x * 10**(places + extra)), 10**(places + extra)), x,
                  gold_value + Fraction(rng.choice([1, -1]), 10**places), gold_value * (1 + REL_TOL * 3),
                  gold_value * (1 - REL_TOL / 3), Fraction(round(x * 10**(places - 1)), 10**(places - 1))]
    r = rng.choice(candidates)
    text = rng.choice([f"{float(r):.{places + extra}f}" if r.denominator > 1 else str(r), tex(r)])
    r = Fraction(text) if "\\" not in text else r
    within = abs(r - gold_value) <= REL_TOL * max(abs(r), abs(gold_value))
    return [Case(box(text), gold, label(within), "decimal-gold")]


def nested_boxes(rng):
    a = rational(rng)
    b = other(rng, a)
    A, Bt = tex(a), tex(b)
    response, gold, lab = rng.choice([
        (f"\\boxed{{\\boxed{{{A}}} \\text{{ or }} \\boxed{{{Bt}}}}}", rng.choice([A, Bt]), "wrong"),
        (f"\\boxed{{\\boxed{{{A}}}, \\boxed{{{Bt}}}}}", rng.choice([A, Bt]), "wrong"),
        (f"\\boxed{{{A} \\text{{ or }} \\boxed{{{Bt}}}}}", Bt, "wrong"),
        (f"\\boxed{{\\boxed{{{A}}}}}", A, "right"),
        (f"\\boxed{{\\boxed{{{A}}}}}", Bt, "wrong"),
    ])
    return [Case(response, gold, lab, "nested-boxes")]


FAMILIES = {negation: 400, unicode_root: 120, subscript: 120, mixed_number: 120, named_tuple: 120, currency: 120,
            degree_trig: 24, complex_form: 24, decimal_gold: 250, nested_boxes: 100}  # ~1,500 cases, ~80 for sympy


def cases() -> list[Case]:
    rng = random.Random(SEED)
    return [c for family, n in FAMILIES.items() for _ in range(n) for c in family(rng)]


def test_hostile_families_have_no_false_positive():
    all_cases = cases()
    exceptions = []
    t0 = time.perf_counter()
    verdicts, pending = [], []
    for k, c in enumerate(all_cases):  # the in-process part, unguarded: an exception is counted
        verdicts.append(Verdict.UNPARSABLE)
        try:
            pred = mv.extract_answer(c.response)
            decided = Verdict.UNPARSABLE if pred is None else mv._decide(pred, c.gold)
        except Exception as e:  # noqa: BLE001 - counted
            exceptions.append((c.family, c.response, f"{type(e).__name__}: {e}"))
            continue
        if isinstance(decided, Verdict):
            verdicts[k] = decided
        else:
            pending.append(k)
    # what needs sympy goes through verify_batch, as the trainer's batches do
    for k, v in zip(pending, mv.verify_batch([all_cases[k].response for k in pending],
                                             [all_cases[k].gold for k in pending])):
        verdicts[k] = v
    took = time.perf_counter() - t0
    false_positives = [(c.family, c.response, c.gold) for c, v in zip(all_cases, verdicts)
                       if v is Verdict.CORRECT and c.label == "wrong"]
    timeouts = [(c.family, c.response, c.gold) for c, v in zip(all_cases, verdicts) if v is Verdict.TIMEOUT]
    rights = Counter(c.family for c in all_cases if c.label == "right")
    accepted = Counter(c.family for c, v in zip(all_cases, verdicts) if c.label == "right" and v is Verdict.CORRECT)
    print(f"\nhostile families: {len(all_cases)} cases ({sum(rights.values())} right by the oracle) in {took:.1f} s: "
          f"{len(exceptions)} exceptions, {len(false_positives)} false positives, {len(timeouts)} timeouts; "
          f"right ones accepted per family: { {f: f'{accepted[f]}/{n}' for f, n in rights.items()} }")
    assert not exceptions, exceptions[:10]
    assert not false_positives, false_positives[:10]
    assert not timeouts, timeouts[:10]
    # not vacuous: each family has right cases, and the verifier accepts nearly all of them
    assert set(rights) == {f.__name__.replace("_", "-") for f in FAMILIES} - {"subscript"} or \
        set(rights) == {f.__name__.replace("_", "-") for f in FAMILIES}
    assert sum(accepted.values()) >= 0.9 * (sum(rights.values()) - rights["subscript"]), (accepted, rights)
