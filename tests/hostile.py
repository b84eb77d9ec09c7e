"""Hostile responses for tests/test_verifier_fuzz.py: one seeded generator per verifier, every response with the
verdict an oracle independent of the verifier knows.

A Case is (response, answer, label, form). label "wrong": the response is wrong by construction (a value computed
here with exact Fractions to differ from the gold, a hedge, a relation chain with a wrong side, a smuggled gold, a
number reused or not given...), so CORRECT is a false positive. label "right": a control, the gold in another exact
form the verifier's documented rules accept (a rejection is a false negative: counted, not a soundness failure).
Countdown labels come from countdown_truth, a parser of its own, for every response. Nothing here imports the
verifiers: the oracle shares no code with them.
"""
from __future__ import annotations

import math
import random
import re
from fractions import Fraction
from typing import NamedTuple


class Case(NamedTuple):
    response: str
    answer: object
    label: str  # "wrong" | "right"
    form: str  # how it was built (for the report)


def _take(batches, n: int):
    """Cases from an endless iterator of lists of cases, until n of them are hostile (controls come on top)."""
    made = 0
    for batch in batches:
        for case in batch:
            if made == n:
                return
            made += case.form != "control"
            yield case


_BLOCKS: dict[str, str] = {}


def _junk(rng: random.Random, n: int, alphabet: str = "abc xyz 0123456789+-=()[]{}\\$.,;:\n") -> str:
    """n characters of `alphabet`: a random window of a block made once (fast, and still seeded)."""
    if alphabet not in _BLOCKS:
        _BLOCKS[alphabet] = "".join(random.Random(alphabet).choices(alphabet, k=300_000))
    start = rng.randrange(300_000 - n)
    return _BLOCKS[alphabet][start:start + n]


FULLWIDTH = str.maketrans("0123456789", "０１２３４５６７８９")
ARABIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
BOLD = str.maketrans("0123456789", "".join(chr(0x1D7CE + k) for k in range(10)))
SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")
LOOKALIKE_DIGITS = str.maketrans("0158", "OlSB")
ZERO_WIDTH = ["\u200b", "\u200c", "\u200d", "\ufeff", "\u00ad", "\u2060"]


# ============================================================================================ countdown

_CD_BAD = re.compile(r"[^0-9+\-*/() \t\r\n]")  # ASCII digits, the four operators, parentheses, ASCII spaces
_CD_TOKEN = re.compile(r"\(+|\)+|[0-9]+|[-+*/]")  # runs of parentheses as one token; spaces only separate
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def cd_eval(text: str) -> tuple[list[int], Fraction] | None:
    """(numbers used, exact value) of `text` read as binary + - * / over non-negative integers with parentheses
    (no unary signs: a leading "-" is not a given number), or None: not such an expression, or a division by
    zero. Shunting-yard, no recursion, no size limits."""
    if _CD_BAD.search(text):
        return None
    out: list[Fraction] = []
    ops: list[str] = []
    leaves: list[int] = []

    def apply() -> None:
        op, b, a = ops.pop(), out.pop(), out.pop()
        if op == "/" and b == 0:
            raise ZeroDivisionError
        out.append(a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b)

    operand = True  # is an operand (number or "(") expected next?
    try:
        for tok in _CD_TOKEN.findall(text):
            if tok[0] in "0123456789":
                if not operand:
                    return None
                n = 0
                for k in range(0, len(tok), 1000):  # int() refuses more than 4,300 digits at once
                    n = n * 10 ** len(tok[k:k + 1000]) + int(tok[k:k + 1000])
                leaves.append(n)
                out.append(Fraction(n))
                operand = False
            elif tok[0] == "(":
                if not operand:
                    return None
                ops.extend(tok)
            elif tok[0] == ")":
                if operand:
                    return None
                closing = len(tok)
                while closing:
                    while ops and ops[-1] != "(":
                        apply()
                    opened = len(ops) - len("".join(ops).rstrip("("))  # "(" on top of the stack
                    if not opened:
                        return None
                    k = min(closing, opened)
                    del ops[len(ops) - k:]
                    closing -= k
            else:
                if operand:
                    return None
                while ops and ops[-1] != "(" and _PREC[ops[-1]] >= _PREC[tok]:
                    apply()
                ops.append(tok)
                operand = True
        if operand:
            return None
        while ops:
            if ops[-1] == "(":
                return None
            apply()
    except ZeroDivisionError:
        return None
    return leaves, out[0]


def countdown_truth(response: str, nums: list[int], target: int) -> bool:
    """The true verdict: is the final <answer>...</answer> (the last pair with no tag inside: the last opening tag
    that is closed, up to its first closing tag) an expression over exactly `nums`, each once, whose exact value
    is `target`?"""
    opened = response.rfind("<answer>", 0, max(0, response.rfind("</answer>")))
    if opened < 0:
        return False
    start = opened + len("<answer>")
    read = cd_eval(response[start:response.find("</answer>", start)])
    return read is not None and sorted(read[0]) == sorted(nums) and read[1] == target


def _cd_tree(rng: random.Random, leaves: list) -> str:
    if len(leaves) == 1:
        return str(leaves[0])
    k = rng.randint(1, len(leaves) - 1)
    return f"({_cd_tree(rng, leaves[:k])}{rng.choice('+-*/')}{_cd_tree(rng, leaves[k:])})"


def _cd_problem(rng: random.Random, rows: list[dict]) -> tuple[list[int], int, str]:
    """(nums, target, a solution): the numbers of a real row (or random ones), a random expression tree over them,
    its value as the target."""
    while True:
        nums = list(rng.choice(rows)["nums"]) if rows and rng.random() < 0.5 else \
            [rng.randint(1, 100) for _ in range(rng.choice((3, 4)))]
        order = nums[:]
        rng.shuffle(order)
        expr = _cd_tree(rng, order)[1:-1]
        read = cd_eval(expr)
        if read and read[1].denominator == 1 and 0 < read[1] <= 10**6:
            return nums, int(read[1]), expr


def _replace_leaf(rng: random.Random, expr: str, fn) -> str:
    """expr with one of its numbers replaced by fn(number)."""
    spots = list(re.finditer(r"\d+", expr))
    m = rng.choice(spots)
    return expr[:m.start()] + fn(m.group()) + expr[m.end():]


def _countdown_forms(rng: random.Random, nums: list[int], target: int, e: str) -> list[tuple]:
    """(form, response or a function that makes it, nums it is judged against) for one problem and its solution
    `e`; the 100 kB ones are made only when drawn."""
    a = rng.choice(nums)
    x, y = rng.randint(1, 99), rng.randint(1, 99)
    d = rng.choice((5, 31, 32, 33, 100, 5000))
    tag = "<answer>{}</answer>".format
    think = f"<think>Try {' and '.join(map(str, nums))}: {target} is the target.</think>\n"
    w = re.sub(r"[-+*/]", lambda m: rng.choice("+-*/"), e, count=rng.randint(1, 3))  # operators changed
    rest = nums[:]
    rest.remove(rng.choice(rest))
    omitted = _cd_tree(rng, rest)[1:-1] if len(rest) > 1 else str(rest[0])

    def leaf(fn):
        return _replace_leaf(rng, e, fn)

    def junk(alphabet="abc 0123456789+-*() \n"):
        return _junk(rng, 100_000, alphabet)

    inside = {  # what stands in one <answer></answer>
        "control": [e, f" {e} ".replace("+", " + ").replace("*", " * ")],
        "wrong-operator": [w],
        "reuse": [f"{e}+{a}-{a}", f"({e})*{a}/{a}", f"{a}/{a}*({e})"],
        "extra-number": [f"{e}+0", f"({e})*1", f"({e})/1", f"{e}-0", f"{e}+{target}-{target}"],
        "not-given": [str(target), f"{target}+{a}-{a}", leaf(lambda s: str(int(s) + rng.choice((1, -1, 10))))],
        "omitted": [omitted],
        "unary": [f"-(-({e}))", f"+({e})", f"--{e}"],
        "python": [f"({e})**1", e.replace("/", "//"), f"{e} if 1 else 0", f"[{e}][0]", f"({e},)", f"{e} # {target}",
                   f"{e};", f"int({e})", f"__import__('os').system('true') or {e}", f"(lambda: {e})()", f"eval('{e}')",
                   f"True*({e})", f"{e}\\\n", f"({e})+0j", f"{e}\x00", f"~~({e})", leaf(lambda s: hex(int(s))),
                   leaf(lambda s: oct(int(s))), leaf(lambda s: bin(int(s))), leaf(lambda s: s + ".0"),
                   leaf(lambda s: s + "e0"), leaf(lambda s: s[0] + "_" + s[1:] if len(s) > 1 else s + "_")],
        "equation": [f"{e}={target}", f"{e} = {target}"],
        "unicode": [e.translate(FULLWIDTH), e.translate(ARABIC), e.translate(BOLD), e.translate(SUPERSCRIPT),
                    e.replace("-", "−").replace("*", "×").replace("/", "÷"),
                    e.replace("+", "＋").replace("*", "∗").replace("/", "／"), e.replace("+", "\u00a0+\u00a0"),
                    leaf(lambda s: s[0] + rng.choice(ZERO_WIDTH) + s[1:]), e.translate(LOOKALIKE_DIGITS),
                    e.replace("*", "x")],
        "huge": ["9**9**9**9", "**".join(map(str, nums)), f"({e})*{'*'.join(['999999999999'] * 3)}/999999999999",
                 "9" * rng.choice((13, 200, 5000)), f"{e}+{'0' * 5000}", "+".join(["1"] * rng.choice((50, 500)))],
        "deep-parens": ["(" * d + e + ")" * d, "(" * 5000 + e, e + ")" * 5000],
        "long": [e.replace("+", " " * 100 + "+")],
    }
    whole = {  # whole responses
        "control": [think + tag(e), f"{tag(w)} wait, {tag(e)}"],
        "wrong-operator": [think + tag(w)],
        "many-tags": [lambda: "<answer>" * 10_000 + e + "</answer>", lambda: tag(e) * 5_000 + tag(w),
                      f"<answer><answer>{e}</answer></answer>", f"{tag(e)}{w}</answer>",
                      f"<answer>{w}<answer>{e}</answer>", f"{tag(e)} then {tag(w)}"],
        "tag-case": [f"<ANSWER>{e}</ANSWER>", f"< answer >{e}</ answer >", f"<answer>{e}", f"{e}</answer>"],
        "100kB": [lambda: junk("abc <>/0123456789+-*() \n") + tag(w), lambda: tag(e) + junk() + tag(w),
                  lambda: tag(e) + junk(), lambda: tag(e + " " * 100_000),
                  lambda: tag("(" * 50_000 + e + ")" * 50_000)],
    }
    by_zero = [(f"{e}+{x}/({y}-{y})", [x, y, y]), (f"({e})*({y}-{y})/({y}-{y})+{x}", [x, y, y, y, y]),
               (f"{e}-{x}*{y}/({y}-{y})", [x, y, y, y])]  # with the numbers they use beside e's
    return ([(form, tag(r), nums) for form, rs in inside.items() for r in rs]
            + [(form, r, nums) for form, rs in whole.items() for r in rs]
            + [("divide-by-zero", tag(r), nums + more) for r, more in by_zero])


def countdown_cases(rng: random.Random, n: int, rows: list[dict] | None = None):
    """n hostile cases and their controls (a generator): each problem's forms sampled, every label from
    countdown_truth (controls checked)."""
    return _take(_countdown_batches(rng, rows or []), n)


def _countdown_batches(rng: random.Random, rows: list[dict]):
    while True:
        nums, target, e = _cd_problem(rng, rows)
        forms = _countdown_forms(rng, nums, target, e)
        batch = []
        for form, make, used_nums in rng.sample(forms, 6) + [f for f in forms if f[0] == "control"][:1]:
            response = make() if callable(make) else make
            answer = {"nums": used_nums, "target": target}
            right = countdown_truth(response, used_nums, target)
            assert right or form != "control", (response, answer)
            batch.append(Case(response, answer, "right" if right else "wrong", form))
        yield batch


# ============================================================================================ math

def _dec(v: Fraction) -> str | None:
    """The exact terminating decimal of v, or None."""
    q, twos, fives = v.denominator, 0, 0
    while q % 2 == 0:
        q, twos = q // 2, twos + 1
    while q % 5 == 0:
        q, fives = q // 5, fives + 1
    if q != 1:
        return None
    places = max(twos, fives, 1)
    scaled = abs(v.numerator) * 10**places // v.denominator
    digits = str(scaled).rjust(places + 1, "0")
    return ("-" if v < 0 else "") + digits[:-places] + "." + digits[-places:]


def _tex(v: Fraction) -> str:
    """Plain LaTeX of a rational: 5, -5, \\frac{3}{4}, -\\frac{3}{4}."""
    if v.denominator == 1:
        return str(v.numerator)
    return ("-" if v < 0 else "") + f"\\frac{{{abs(v.numerator)}}}{{{v.denominator}}}"


def _forms(rng: random.Random, v: Fraction, item: bool = False) -> str:
    """v written in one of many exactly equal ways (as an item of a tuple: no thousands commas, no mixed number)."""
    p, q = v.numerator, v.denominator
    sign, ap = ("-" if p < 0 else ""), abs(p)
    forms = [_tex(v), f"\\left({_tex(v)}\\right)", f"{{{_tex(v)}}}", f"\\frac{{{3 * p}}}{{{3 * q}}}"]
    if q == 1:
        forms += [str(p), f"{p}.0", f"{p}.000", f"+{p}" if p >= 0 else str(p)]
        if ap >= 1000 and not item:
            forms += [f"{p:,}", f"{p:,}".replace(",", "{,}"), f"{p:,}".replace(",", "\\,")]
    else:
        forms += [f"\\frac{{{p}}}{{{q}}}", f"{sign}\\dfrac{{{ap}}}{{{q}}}", f"{sign}\\tfrac{{{ap}}}{{{q}}}", f"{p}/{q}",
                  f"{sign}\\frac {{ {ap} }} {{ {q} }}", f"{p} \\div {q}"]
        if ap < 10 and q < 10:
            forms.append(f"{sign}\\frac{ap}{q}")
        if ap > q and not item:
            forms.append(f"{sign}{ap // q}\\frac{{{ap % q}}}{{{q}}}")
    if _dec(v):
        forms.append(_dec(v))
    return rng.choice(forms)


def _rational(rng: random.Random) -> Fraction:
    kind = rng.random()
    if kind < 0.4:
        return Fraction(rng.randint(-20, 200))
    if kind < 0.55:
        return Fraction(rng.randint(1, 10 ** rng.randint(3, 12)))
    q = rng.randint(2, 60)
    return Fraction(rng.randint(-3 * q, 10 * q), q) or Fraction(1, q)


DECIMAL_REL_TOL = Fraction(1, 10**6)  # the math verifier's documented tolerance where the gold is a decimal ("2.5")


def within_decimal_tolerance(w: Fraction, g: Fraction, gold_text: str) -> bool:
    """Is w right for the gold g written gold_text under that rule (a decimal gold: relative 1e-6, else exact)?"""
    if "." not in gold_text:
        return w == g
    return abs(w - g) <= DECIMAL_REL_TOL * max(abs(w), abs(g))


def _near(rng: random.Random, g: Fraction, gold_text: str = "") -> Fraction:
    """A rational different from g, near it (off by one, a sign, a tiny amount, a factor of ten...), and outside
    the tolerance of a decimal gold_text."""
    while True:
        k = rng.randint(1, 15)
        w = rng.choice([g + 1, g - 1, g + 2, g - 10, 2 * g, -g, g * 10, g / 10, g + Fraction(1, 10**k),
                        g - Fraction(1, 10**k), g + Fraction(1, g.denominator + 1), g * 100, g / 100,
                        g + Fraction(1, 2), Fraction(g.numerator + 1, g.denominator),
                        Fraction(g.numerator, g.denominator + 1)])
        if not within_decimal_tolerance(w, g, gold_text or "0"):
            return w


_ENVELOPES = [
    "{r}The answer is $\\boxed{{{a}}}$.", "{r}\\boxed{{{a}}}", "{r}Answer: {a}", "{r}Answer: ${a}$",
    "{r}<answer>{a}</answer>", "{r}The final answer is $\\boxed{{{a}}}$. I hope it is correct.", "{r}**Answer:** ${a}$",
    "{r}$$\\boxed{{{a}}}$$", "{r}\\fbox{{{a}}}", "{r}Therefore, the answer is ${a}$.",
    "{r}<answer>The answer is $\\boxed{{{a}}}$</answer>",
]


def _envelope(rng: random.Random, a: str, gold_text: str) -> str:
    """The final answer `a` in one of the usual closings, after reasoning that may mention the gold."""
    r = rng.choice(["", "Let me think step by step.\n\n",
                    f"At first I thought the answer is {gold_text}, but that was a slip. Checking again:\n\n",
                    f"We try $x = {gold_text}$: no, the answer is not {gold_text}. So\n\n"])
    return rng.choice(_ENVELOPES).format(r=r, a=a)


def _flat(forms: dict[str, list]) -> list[tuple[str, object]]:
    return [(form, x) for form, xs in forms.items() for x in xs]


def _hedges(g: str, w: str, d: str) -> list[tuple[str, str]]:
    """Final answers that name the gold and a wrong value w (d = |w - g|), negate the gold, hide it beside w, or
    chain the two: all wrong."""
    return _flat({
        "hedge": [f"{g}, {w}", f"{w}, {g}", f"{g} \\text{{ or }} {w}", f"{g} or {w}", f"{g}; {w}",
                  f"{g} \\text{{ and }} {w}", f"\\{{{g}, {w}\\}}", f"{g} \\quad {w}", f"{g} \\pm {d}",
                  f"(A) {g} (B) {w}", f"{g} \\lor {w}",
                  f"\\textbf{{(A)}}\\ {g} \\qquad \\textbf{{(B)}}\\ {w}", f"{g} \\text{{ (or }} {w}\\text{{)}}",
                  f"{w} \\\\ {g}", f"{g} \\newline {w}", f"{g} \\text{{ or maybe }} {w}", f"{g} or more",
                  f"{g} or less", f"{g} is wrong", f"at least {g}", f"{g} or so"],
        "chain": [f"x = {w} = {g}", f"x = {g} = {w}", f"{g} = {w}", f"{w} = {g}", f"y={w}", f"x = {g} + 0 = {w}",
                  f"{g} \\approx {w}", f"{w} \\equiv {g}", f"{g} \\sum {w}", f"{g} \\max {w}", f"{g} \\in {w}",
                  f"{g} \\ldots {w}", f"{g} \\to {w}", f"{g} \\sim {w}"],
        "negated": [f"\\text{{not }} {g}", f"\\text{{never }}{g}", f"\\neg {g}", f"\\not{{{g}}}",
                    f"\\cancel{{{g}}} {w}", f"\\sout{{{g}}}{w}", f"\\xcancel{{{g}}}\\ {w}", f"{g}\u0338", f"{g}\u0336",
                    f"{g} \\text{{ is wrong}}", f"\\neq {g}", f"x \\ne {g}"],
        "smuggled": [f"\\phantom{{{g}}}{w}", f"{w}\\phantom{{{g}}}", f"\\hphantom{{{g}}}{w}", f"\\vphantom{{{g}}}{w}",
                     f"{{\\color{{white}}{g}}}{w}", f"\\textcolor{{white}}{{{g}}}{w}", f"\\overset{{{g}}}{{{w}}}",
                     f"\\underset{{{g}}}{{{w}}}", f"\\stackrel{{{g}}}{{{w}}}", f"{w}\\tag{{{g}}}",
                     f"{w} \\label{{{g}}}", f"{w}\\footnote{{{g}}}", f"\\iffalse {g} \\fi {w}", f"{w} % {g}",
                     f"\\mathrlap{{{g}}}{w}", f"\\llap{{{g}}}{w}", f"\\rlap{{{g}}}{w}", f"\\href{{{g}}}{{{w}}}",
                     f"\\hspace{{{g}cm}}{w}", f"\\begin{{comment}}{g}\\end{{comment}}{w}"],
        "injection": [f"\\input{{/etc/passwd}}{w}", f"\\def\\x{{{w}}}\\x", f"\\immediate\\write{{x}}{w}",
                      f"\\csname relax\\endcsname {w}", f"\\begin{{verbatim}}{g}\\end{{verbatim}} {w}",
                      f"\\catcode`\\x=13 {w}", f"{w}\\end{{document}}{g}", f"\\renewcommand{{\\x}}{{{g}}}{w}"],
    })


def _changed_gold(g: Fraction, gt: str) -> list[tuple[str, str]]:
    """The gold with something that changes its value (each kept only where the new value differs)."""
    changed = [f"{gt}+i", f"{gt}+x", f"{gt}x" if g else f"{gt}+x^2"]
    if "." not in gt:  # within a decimal gold's tolerance these are right
        changed += [f"{gt}+\\frac{{1}}{{10^{{12}}}}", f"{gt} - 10^{{-15}}", f"{gt} + 0.000000000001"]
    if g not in (0, 1, -1):  # (-1^2 = -1)
        changed += [f"{gt}^2", f"({gt})^{{2}}", f"{gt}²", f"{gt} \\text{{ squared}}", f"({gt})^{{-1}}", f"({gt})^3",
                    f"{gt}³", f"{gt} \\text{{ cubed}}"]
    if g >= 0 and g not in (0, 1):
        changed.append(f"\\sqrt{{{gt}}}")
    if g.denominator == 1 and 3 <= g <= 20:
        changed += [f"{gt}!", f"\\Gamma({gt})"]
    if g:
        changed += [f"-{gt}" if g > 0 else f"-({gt})", f"\\frac{{{gt}}}{{2}}", f"2 \\cdot {gt}", f"{gt} \\times 10",
                    f"{gt} \\text{{ million}}", f"{gt}\\text{{ thousand}}", f"{gt} \\text{{ billion}}",
                    f"{gt} \\times 10^{{-1}}"]
    if g.denominator == 1 and g > 0:  # digits around the plain integer
        n = g.numerator
        changed += [f"{n}e3", f"{n}0", f"0.{n}", f"{n}.5", f"1{n}", f"{n}_{{2}}" if n > 1 else f"{n}_{{7}}+1"]
    if g < 0:
        changed.append(f"|{gt}|")
    return _flat({"changed": changed})


def _pathological(rng: random.Random, w: str) -> list[tuple[str, str]]:
    """Answers whose value is w, or no number near the gold, in pathological clothing."""
    d = rng.choice((10, 40, 41, 500, 5000))
    return _flat({
        "huge": ["\\Gamma(10^{10})", "9^{9^{9^{9}}}", "9^9^9^9", "10^{10^{10}}", "(10^{10})!", "1000000!",
                 "2^{2^{2^{2^{2}}}}", "(((3!)!)!)!", "10^{-10^{10}}", "\\binom{10^{12}}{5 \\cdot 10^{11}}", "9" * 999,
                 "\\frac{1}{" + "9" * 500 + "}", "10^{10^{10^{10}}} - 10^{10^{10^{10}}} + " + w,
                 "2^{40000} \\cdot 2^{40000}", "\\sqrt[10^{10}]{2}", "e^{e^{e^{e^{e}}}}", "\\tan(\\frac{\\pi}{2})",
                 "0^{-1}", "\\frac{0}{0}", "\\infty", "-\\infty", "\\infty - \\infty", "NaN"],
        "nested": ["{" * d + w + "}" * d, "(" * d + w + ")" * d, "\\left(" * d + w + "\\right)" * d,
                   "\\sqrt{" * d + w + "}" * d if d < 50 else "\\sqrt{" * d + w, "{" * d + w, w + "}" * d,
                   "\\frac{1}{" * 2 * d + w + "}" * 2 * d],
        "long": [w + "+0" * 400, "+".join([w] * 300), w + " " * 5000],
    })


def _math_rational(rng: random.Random, g: Fraction, gt: str) -> list[Case]:
    """Cases for a rational gold g written gt."""
    w = _near(rng, g, gt)
    ws, gs = _forms(rng, w), _forms(rng, g)
    cases = [Case(_envelope(rng, ws, gt), gt, "wrong", "near-value"),
             Case(_envelope(rng, gs, gt), gt, "right", "control")]
    h = next(x for x in (w, g + 3, g + 5) if x not in (0, 1))  # beside the gold, 0 or 1 may read as a product
    hedges = _hedges(rng.choice([gt, gs]), _forms(rng, h), _forms(rng, abs(h - g)))  # equal to it: "10 (1)"
    form, a = rng.choice(hedges + _changed_gold(g, gt))
    cases.append(Case(_envelope(rng, a, gt), gt, "wrong", form))
    if rng.random() < 0.25:
        form, a = rng.choice(_pathological(rng, ws))
        cases.append(Case(_envelope(rng, a, gt), gt, "wrong", form))
    if rng.random() < 0.2:
        cases.append(_boxes_and_text(rng, g, gt, ws))
    return cases


def _boxes_and_text(rng: random.Random, gv: Fraction, g: str, w: str) -> Case:
    """Several boxes, floods, unicode: the final answer is w (or there is none)."""
    junk = _junk(rng, 100_000)
    reversed_w = w[::-1] if not re.fullmatch(r"-?\d+", w[::-1]) or Fraction(w[::-1]) != gv else w
    form, response = rng.choice(_flat({
        "boxes": [f"\\boxed{{{g}}} ... so finally \\boxed{{{w}}}", f"\\boxed{{{g}}}\\boxed{{{w}}}",
                  f"\\boxed{{{w}}} and \\boxed{{{g}", f"\\boxed{{{g}}}" * 5000 + f"\\boxed{{{w}}}",
                  f"\\boxed{{{w}}}" + "\\boxed{" * 10_000, f"<answer>{g}</answer> \\boxed{{{w}}}",
                  f"\\fbox{{{g}}} \\boxed{{{w}}}", f"\\boxed{{{w}}}\n\nAnswer: {g}"],
        "100kB": [junk + f"\\boxed{{{w}}}", f"\\boxed{{{g}}}" + junk + f"\\boxed{{{w}}}", f"\\boxed{{{'1' * 100_000}}}",
                  "\\" * 50_000 + f"\\boxed{{{w}}}", "$" * 20_001 + f"\\boxed{{{w}}}", "}" * 50_000 + f"\\boxed{{{w}}}",
                  f"Answer: {g}" + "\n" * 10_001 + f"Answer: {w}"],
        "unicode": [f"\\boxed{{{w.translate(FULLWIDTH)}}}", f"\\boxed{{{w.translate(BOLD)}}}",
                    f"\\boxed{{{w.translate(ARABIC)}}}", f"\\boxed{{{w}{rng.choice(ZERO_WIDTH)}}}",
                    f"\\boxed{{\u202e{reversed_w}}}",  # shows w, holds w reversed: neither is the gold
                    f"\\boxed{{{rng.choice(ZERO_WIDTH)}{w}}}", f"\\boxed{{{w}\u00a0}}",
                    f"\\bоxed{{{g}}} \\boxed{{{w}}}"],  # a Cyrillic о: not a box
    }))
    return Case(response, g, "wrong", form)


def _surd(rng: random.Random) -> tuple[Fraction, int]:
    """c * sqrt(r): r squarefree > 1, c a nonzero rational."""
    r = rng.choice([2, 3, 5, 6, 7, 10, 11, 13, 14, 15, 17, 19, 21, 22, 23, 29, 30, 31, 101, 1009])
    c = Fraction(rng.randint(1, 12), rng.choice([1, 1, 1, 2, 3, 4, 5]))
    return c, r


def _surd_tex(c: Fraction, r: int, style: int = 0) -> str:
    """c sqrt(r) in LaTeX, three ways: 2\\sqrt{3}, 2\\sqrt3, \\sqrt{12} (or with a fraction for c)."""
    coef = "" if c.numerator == 1 else str(c.numerator)
    if c.denominator == 1:
        short = f"{coef}\\sqrt{r}" if r < 10 else f"{coef}\\sqrt{{{r}}}"
        return [f"{coef}\\sqrt{{{r}}}", short, f"\\sqrt{{{c.numerator**2 * r}}}"][style % 3]
    return [f"\\frac{{{coef}\\sqrt{{{r}}}}}{{{c.denominator}}}", f"\\dfrac{{{coef}\\sqrt{{{r}}}}}{{{c.denominator}}}",
            f"\\frac{{{c.numerator}}}{{{c.denominator}}}\\sqrt{{{r}}}"][style % 3]


def _irrational_wrongs(rng: random.Random, value: float) -> str:
    """A rational near an irrational value: a decimal, a fraction from its continued fraction, a float."""
    k = rng.choice([1, 2, 3, 4, 6, 8, 10, 12, 15, 17] if rng.random() < 0.9 else [12, 15, 16, 17])
    kind = rng.randrange(3)
    if kind == 0:
        return f"{value:.{k}f}"
    if kind == 1:
        return _tex(Fraction(value).limit_denominator(10 ** rng.randint(1, 6)))
    return repr(value) if rng.random() < 0.2 else str(round(value, 3))


def _math_surd(rng: random.Random) -> list[Case]:
    c, r = _surd(rng)
    gt = _surd_tex(c, r, rng.randrange(2))
    value = float(c) * math.sqrt(r)
    n2 = c.numerator**2 * r
    surd = _surd_tex(c, r)
    neighbours = [f"\\sqrt{{{n2 + 1}}}" if c.denominator == 1 else f"\\frac{{\\sqrt{{{n2 + 1}}}}}{{{c.denominator}}}",
                  _surd_tex(c + 1, r), _surd_tex(c, r + 1 if r + 1 != 4 else 6), f"{surd}+10^{{-13}}", surd + "^2",
                  f"-{surd}", f"\\pm {surd}", f"{gt}, -{gt}"]
    cases = [Case(_envelope(rng, _irrational_wrongs(rng, value), gt), gt, "wrong", "irrational-approx"),
             Case(_envelope(rng, rng.choice(neighbours), gt), gt, "wrong", "irrational-neighbour")]
    if rng.random() < 0.3:
        cases.append(Case(_envelope(rng, _surd_tex(c, r, rng.randrange(3)), gt), gt, "right", "control"))
    return cases


def _math_pi(rng: random.Random) -> list[Case]:
    a = Fraction(rng.randint(1, 12), rng.choice([1, 2, 3, 4, 6]))
    p = "" if a.numerator == 1 else a.numerator
    gt = f"\\frac{{{p}\\pi}}{{{a.denominator}}}" if a.denominator > 1 else f"{p}\\pi"
    value = float(a) * math.pi
    wrong = rng.choice([_irrational_wrongs(rng, value), _tex(a * Fraction(355, 113)), _tex(a * Fraction(22, 7)),
                        f"{_tex(a)} \\cdot 3.14", f"{_tex(a + 1)}\\pi", f"{_tex(a)}\\pi^2",
                        f"\\frac{{{_tex(a)}}}{{\\pi}}", f"{_tex(a)}\\pi + 10^{{-14}}"])
    cases = [Case(_envelope(rng, wrong, gt), gt, "wrong", "irrational-approx")]
    if rng.random() < 0.3:
        right = f"{_tex(a)}\\pi" if a.denominator == 1 else f"\\frac{{{a.numerator}}}{{{a.denominator}}}\\pi"
        cases.append(Case(_envelope(rng, right, gt), gt, "right", "control"))
    return cases


def _math_decimal(rng: random.Random) -> list[Case]:
    """A decimal gold (an approximation: the verifier's tolerance applies): wrong values lie far outside it."""
    places = rng.randint(1, 4)
    g = Fraction(rng.randint(10**places, 10**(places + 5)), 10**places)
    gt = _dec(g)
    w = g * (1 + rng.choice([1, -1]) * Fraction(rng.randint(1, 1000), 10**rng.randint(3, 4)))
    w = Fraction(round(w * 10**(places + 6)), 10**(places + 6))
    assert abs(w - g) > Fraction(1, 10**5) * abs(g)  # far outside the 1e-6 tolerance
    return [Case(_envelope(rng, _dec(w) or _tex(w), gt), gt, "wrong", "near-value"),
            Case(_envelope(rng, _forms(rng, g), gt), gt, "right", "control")]


def _poly(k: list[int]) -> str:
    """k[0] x^2 + k[1] x + k[2] in LaTeX."""
    text = f"{k[0]}x^2+{k[1]}x+{k[2]}" if k[0] else f"{k[1]}x+{k[2]}"
    return re.sub(r"(?<!\d)1x", "x", text.replace("+-", "-"))


def _math_structure(rng: random.Random) -> list[Case]:
    """Tuples, intervals, sets, polynomials, matrices, choice letters, long lists: one part changed, or hedged."""
    a, b, c = (_rational(rng) for _ in range(3))
    b = b if b != a else a + 1
    c = c if c not in (a, b) else max(a, b) + 1
    T = _tex
    kind = rng.randrange(7)
    if kind == 0:  # ordered pair
        gt = f"({T(a)}, {T(b)})"
        wrongs = [f"({T(a)}, {T(_near(rng, b))})", f"({T(_near(rng, a))}, {T(b)})", f"({T(b)}, {T(a)})",
                  f"({T(a)}, {T(b)}, {T(c)})", f"[{T(a)}, {T(b)}]", f"({T(a)}, {T(b)}]", f"\\{{{T(a)}, {T(b)}\\}}"]
        right = f"\\left( {_forms(rng, a, item=True)}, {_forms(rng, b, item=True)} \\right)"
    elif kind == 1:  # union of intervals
        lo, hi = sorted((a, b))
        gt = f"(-\\infty, {T(lo)}) \\cup ({T(hi)}, \\infty)"
        wrongs = [f"(-\\infty, {T(lo)}] \\cup ({T(hi)}, \\infty)", f"(-\\infty, {T(lo)}) \\cup [{T(hi)}, \\infty)",
                  f"(-\\infty, {T(_near(rng, lo))}) \\cup ({T(hi)}, \\infty)", f"({T(lo)}, {T(hi)})",
                  f"(-\\infty, {T(hi)}) \\cup ({T(lo)}, \\infty)", f"(-\\infty, {T(lo)})",
                  f"{gt} \\cup \\{{{T((lo + hi) / 2)}\\}}"]
        right = f"({T(hi)}, \\infty) \\cup (-\\infty, {T(lo)})"
    elif kind == 2:  # unordered set of solutions
        gt = f"{T(a)}, {T(b)}, {T(c)}"
        extra = max(a, b, c) + 1
        wrongs = [f"{T(a)}, {T(b)}", f"{T(a)}, {T(b)}, {T(c)}, {T(extra)}", f"{T(a)}, {T(b)}, {T(extra)}",
                  f"{T(a)}, {T(a)}, {T(b)}", f"\\{{{T(a)}, {T(b)}\\}}", f"{T(a)}"]
        right = rng.choice([f"{T(c)}, {T(a)}, {T(b)}", f"\\{{{T(b)}, {T(c)}, {T(a)}\\}}"])
    elif kind == 3:  # polynomial in x
        k = [rng.randint(-9, 9) or 1, rng.randint(-9, 9), rng.randint(-9, 9)]
        gt = _poly(k)
        k2 = k[:]
        k2[rng.randrange(3)] += rng.choice([1, -1, 2])
        wrongs = [_poly(k2), f"{gt}+x^3", f"{gt}+(5x-11)(6x-14)", f"({gt})^2", f"{gt} = 0", f"{gt}, {_poly(k2)}"]
        right = f"{k[2]}+{k[1]}x+{k[0]}x^2".replace("+-", "-")  # reordered: the symbolic step (kept rare)
    elif kind == 4:  # 2x2 matrix
        m = [a, b, c, _near(rng, a)]
        mat = "\\begin{{pmatrix}} {} & {} \\\\ {} & {} \\end{{pmatrix}}".format
        gt = mat(*map(T, m))
        m2 = m[:]
        j = rng.randrange(4)
        m2[j] = _near(rng, m[j])
        wrongs = [mat(*map(T, m2)), mat(*map(T, [m[0], m[2], m[1], m[3]])),
                  f"\\begin{{pmatrix}} {T(m[0])} & {T(m[1])} \\end{{pmatrix}}"]
        right = gt.replace("pmatrix", "bmatrix")
    elif kind == 5:  # a long list of expressions: n x n comparisons, the worst case of the in-process budget
        items = [f"x^2y+{i}xy+\\frac{{{rng.randint(1, 99)}}}{{x+y}}" for i in range(rng.randint(10, 32))]
        gt = ", ".join(items)
        changed = items[:]
        changed[rng.randrange(len(items))] += "+1"
        wrongs = [", ".join(rng.sample(changed, len(changed))), ", ".join(items[1:]), f"{gt}, x"]
        right = ", ".join(rng.sample(items, len(items)))
    else:  # multiple-choice letter
        letter = rng.choice("ABCDE")
        other = rng.choice([x for x in "ABCDE" if x != letter])
        gt = letter
        wrongs = ["(A) (B) (C) (D) (E)", f"\\text{{({letter}) or ({other})}}", f"({letter}) ({other})", f"({other})",
                  f"\\textbf{{({other})}}", other, f"\\mathrm{{({letter})}}, \\mathrm{{({other})}}",
                  f"({other}) {T(a)}", f"(\\text{{{letter}}})\\ (\\text{{{other}}})"]
        right = rng.choice([f"({letter})", f"\\textbf{{({letter})}}", letter, f"\\text{{({letter})}}"])
    cases = [Case(_envelope(rng, rng.choice(wrongs), gt), gt, "wrong", "structure")]
    if kind != 3 or rng.random() < 0.1:
        cases.append(Case(_envelope(rng, right, gt), gt, "right", "control"))
    return cases


def _math_special(rng: random.Random) -> list[Case]:
    """Golds 0 and 2^e: tiny nonzero values, off-by-one on 20 to 90 digits."""
    if rng.random() < 0.5:
        gt = "0"
        wrong = rng.choice(["10^{-100}", "\\frac{1}{10^{30}}", "2^{-10000}", "10^{-10^{10}}", "0.0000000000001",
                            "-0.000001", "\\epsilon", "1", "0.\\overline{01}", "0, 1", "\\pm 1"])
        right = rng.choice(["0", "0.0", "-0", "\\frac{0}{5}", "0.000"])
    else:
        e = rng.randint(60, 300)  # 2^e has more digits than a double holds: its float is not 2^e
        gt = f"2^{{{e}}}"
        wrong = rng.choice([f"2^{{{e}}}+1", f"2^{{{e + 1}}}", str(2**e + 1), str(2**e - 1), f"{float(2**e):.15e}",
                            f"2^{{{e}}}-10^{{-30}}", f"4^{{{e}}}", f"4^{{{e // 2}}}+1"])
        right = rng.choice([str(2**e), f"2^{{{e}}}", f"4^{{{e // 2}}}" if e % 2 == 0 else f"2 \\cdot 2^{{{e - 1}}}"])
    return [Case(_envelope(rng, wrong, gt), gt, "wrong", "special"),
            Case(_envelope(rng, right, gt), gt, "right", "control")]


_WORDS = ["yes", "no", "even", "odd", "Monday", "Tuesday", "circle", "parabola", "ellipse", "Alice", "Bob", "never"]


def _math_text(rng: random.Random) -> list[Case]:
    """A word gold ("yes", "\\text{even}"): another word, a negated or hidden gold, a hedge."""
    g, o = rng.sample(_WORDS, 2)
    gt = rng.choice([g, f"\\text{{{g}}}", f"\\text{{({g})}}"])
    wrong = rng.choice([o, f"\\text{{{o}}}", f"\\not{{{g}}}", f"\\neg \\text{{{g}}}", f"\\cancel{{{g}}}",
                        f"\\sout{{{g}}}", f"\\text{{not }}{g}", f"\\text{{not {g}}}", f"\\text{{{g} or {o}}}",
                        f"{g}, {o}", f"\\text{{{g}}}, \\text{{{o}}}", f"\\phantom{{{g}}}{o}",
                        f"\\text{{\\cancel{{{g}}}}}", f"{o} \\tag{{{g}}}", f"\\overset{{{g}}}{{{o}}}",
                        f"\\text{{{g}}}\\text{{{o}}}", f"\\textcolor{{white}}{{{g}}}{o}", f"{g}\u0338",
                        f"\\xcancel{{\\text{{{g}}}}}"])
    right = rng.choice([g, f"\\text{{{g}}}", f"\\textbf{{{g}}}", f"\\text{{ {g} }}", f"\\mathrm{{{g}}}"])
    return [Case(_envelope(rng, wrong, gt), gt, "wrong", "text"),
            Case(_envelope(rng, right, gt), gt, "right", "control")]


_GOLD_RATIONAL = re.compile(r"(-?)(?:(\d+)|\\[dt]?frac\{(\d+)\}\{(\d+)\})")


def real_rational_golds(answers: list[str]) -> list[tuple[Fraction, str]]:
    """The gold answers of a real data set that are plainly integers or \\frac{a}{b}, with their values."""
    out = []
    for a in answers:
        m = _GOLD_RATIONAL.fullmatch(str(a).strip())
        if m and (m.group(2) is not None or int(m.group(4))):
            v = Fraction(int(m.group(2))) if m.group(2) is not None else Fraction(int(m.group(3)), int(m.group(4)))
            out.append((-v if m.group(1) else v, str(a).strip()))
    return out


def math_cases(rng: random.Random, n: int, real_golds: list[tuple[Fraction, str]] | None = None):
    """n hostile cases and their controls (a generator) over rational golds (real ones where given), decimals,
    surds, multiples of pi, structures, words, 0, 2^k."""
    return _take(_math_batches(rng, real_golds or []), n)


def _math_batches(rng: random.Random, real_golds: list[tuple[Fraction, str]]):
    while True:
        out: list[Case] = []
        kind = rng.random()
        if kind < 0.55:
            if real_golds and rng.random() < 0.5:
                g, gt = rng.choice(real_golds)
            else:
                g = _rational(rng)
                gt = _tex(g) if rng.random() < 0.8 else _forms(rng, g)
            out += _math_rational(rng, g, gt)
        elif kind < 0.65:
            out += _math_surd(rng)
        elif kind < 0.72:
            out += _math_pi(rng)
        elif kind < 0.8:
            out += _math_decimal(rng)
        elif kind < 0.92:
            out += _math_structure(rng)
        elif kind < 0.95:
            out += _math_text(rng)
        else:
            out += _math_special(rng)
        yield out


# ============================================================================================ choice

_PLAIN_NUMBER = re.compile(r"-?\s*\d+(?:\.\d+)?")  # "12.9", "- 1" (Geometry3K writes some signs apart)


def _places(text: str) -> int | None:
    m = re.fullmatch(r"-?\d*\.(\d+)", text.strip())
    return len(m.group(1)) if m else None


class Problem(NamedTuple):
    choices: list[str]
    values: list[float]  # the oracle's value of each choice: exact forms evaluated here, or the data's precise value
    right: int

    @property
    def letter(self) -> str:
        return "ABCD"[self.right]

    def answer(self) -> dict:
        return {"letter": self.letter, "value": self.choices[self.right], "choices": self.choices,
                "precise_values": self.values}


def _synthetic_choice(rng: random.Random) -> tuple[str, float]:
    kind = rng.randrange(6)
    if kind == 0:
        n = rng.randint(1, 400)
        return str(n), float(n)
    if kind == 1:
        v = Fraction(rng.randint(10, 99999), 10 ** rng.randint(1, 2))
        return _dec(v), float(v)
    if kind == 2:
        c, r = rng.randint(1, 9), rng.choice([2, 3, 5, 6, 7, 10, 11, 13])
        return (f"{c} \\sqrt {{ {r} }}" if c > 1 else f"\\sqrt {{ {r} }}"), c * math.sqrt(r)
    if kind == 3:
        p, q = rng.randint(1, 30), rng.randint(2, 13)
        return f"\\frac {{ {p} }} {{ {q} }}", p / q
    if kind == 4:
        p, q = rng.randint(1, 12), rng.choice([2, 3, 4, 5, 6])
        return f"\\frac {{ {p if p > 1 else ''} \\pi }} {{ {q} }}".replace("{  \\pi", "{ \\pi"), p * math.pi / q
    n = rng.randint(20, 170)
    return str(n), float(n)


def synthetic_problem(rng: random.Random) -> Problem:
    """Four choices of one kind-mix with distinct values (sometimes neighbours: 119, 120, 121)."""
    while True:
        if rng.random() < 0.15:
            base = rng.randint(5, 300)
            picks = [(str(base + d), float(base + d)) for d in rng.sample([-2, -1, 0, 1, 2, 5], 4)]
        else:
            picks = [_synthetic_choice(rng) for _ in range(4)]
        values = [v for _, v in picks]
        if all(abs(x - y) > 1e-6 * max(1, abs(x)) for i, x in enumerate(values) for y in values[i + 1:]):
            return Problem([t for t, _ in picks], values, rng.randrange(4))


def real_problem(answer: dict) -> Problem | None:
    """A loaded Geometry3K problem with the oracle's values: a plain decimal choice read here (the data's precise
    value is sometimes off: "- 1" has 0.0), any other choice from the data's precise_values; None when two choices
    share the right value (the oracle then stays out)."""
    values = []
    for text, precise in zip(answer["choices"], answer.get("precise_values") or [None] * 4):
        t = str(text).strip()
        values.append(float(Fraction(t.replace(" ", ""))) if _PLAIN_NUMBER.fullmatch(t) else precise)
    if len(values) != 4 or any(v is None for v in values) or answer["letter"] not in "ABCD":
        return None
    right = "ABCD".index(answer["letter"])
    if any(abs(v - values[right]) <= 1e-6 * max(1, abs(v)) for i, v in enumerate(values) if i != right):
        return None
    return Problem(list(answer["choices"]), values, right)


def value_is_wrong(x: Fraction, x_places: int | None, p: Problem, choices_known: bool = True) -> bool:
    """The oracle for a number x answered (x_places: its decimal places if written as a plain decimal): True when,
    by the documented rule with a 1.5x margin, x cannot count as the right choice: it is not close to the right
    value (exact up to 1e-9; rounding only to the gold's stated decimals, or to the response's own >= 2 decimals),
    or a choice of another value is strictly nearer."""
    v = p.values[p.right]
    gold_places = _places(p.choices[p.right])
    tol = 1e-9 * max(1.0, abs(v))
    if gold_places is not None:
        tol = max(tol, 0.5 * 10.0**-gold_places)
    if x_places is not None and x_places >= 2:
        tol = max(tol, 0.5 * 10.0**-x_places)
    xf = float(x)
    d_right = abs(xf - v)
    if d_right > 1.5 * tol + 1e-12:
        return True
    if not choices_known:
        return False
    d_other = min(abs(xf - w) for i, w in enumerate(p.values) if i != p.right)
    return d_other < d_right - 1e-6 * max(1.0, abs(v))


def _number_text(rng: random.Random, x: Fraction) -> tuple[str, int | None]:
    """x as a plain decimal with some places (rounded), and those places (None for an integer)."""
    if x.denominator == 1 and rng.random() < 0.5:
        return str(x.numerator), None
    k = rng.randint(1, 6)
    text = f"{float(x):.{k}f}"
    return text, k


def _choice_value_cases(rng: random.Random, p: Problem, truth) -> list[Case]:
    """Numbers that must not count as the right choice, checked by value_is_wrong after they are written."""
    out = []
    v = p.values[p.right]
    j = rng.choice([i for i in range(4) if i != p.right])
    w = p.values[j]
    known = isinstance(truth, dict) and bool(truth.get("choices"))
    candidates = [
        Fraction(w), Fraction(w) + Fraction(rng.choice([1, 10, 25, 40, 45]), 100) * Fraction(v - w),
        Fraction((v + w) / 2), Fraction(v) + rng.choice([1, -1]) * Fraction(rng.choice([1, 5, 10, 100, 1000]), 1000),
        Fraction(v) * (1 + Fraction(rng.choice([1, -1]) * rng.choice([2, 5, 10, 50]), 1000)), Fraction(round(v) + 1),
        Fraction(round(v) - 1), Fraction(0), Fraction(-v), Fraction(v) * 10, Fraction(v) + 1000,
    ]
    for x in rng.sample(candidates, 4):
        text, places = _number_text(rng, x)
        exact = Fraction(text)
        if not value_is_wrong(exact, places, p, known):
            continue
        dressed = rng.choice([text, f"x = {text}", f"{text}^\\circ", f"{text}°", f"{text} cm", f"m \\angle B = {text}",
                              f"{p.choices[p.right]} = {text}" if known else text, f"\\approx {text}",
                              text.translate(FULLWIDTH), f"{{{{{{{text}}}}}}}", f"\\text{{{text}}}"])
        out.append(Case(_choice_envelope(rng, dressed), truth, "wrong", "value"))
    return out


def _choice_envelope(rng: random.Random, a: str) -> str:
    return rng.choice(["<answer>{}</answer>", "\\boxed{{{}}}", "The answer is {}.", "Answer: {}",
                       "Let me compute. <answer>{}</answer>", "<answer>The answer is {}</answer>"]).format(a)


def _choice_letter_cases(rng: random.Random, p: Problem, truth) -> list[Case]:
    L = p.letter
    W = rng.choice([x for x in "ABCD" if x != L])
    c = p.choices
    j = "ABCD".index(W)
    cyr = {"A": "А", "B": "В", "C": "С", "D": "Д"}
    r, o = c[p.right], c[j]  # the right choice's text, the other's
    wrong = _flat({
        "wrong-letter": [f"<answer>{W}</answer>", f"\\boxed{{{W}}}", f"The answer is {W}.", f"Answer: ({W})",
                         f"<answer>Option {W}</answer>", f"<answer>\\text{{{W}}}</answer>",
                         f"<answer>({W}) {o}</answer>", f"<answer>{W}. {o}</answer>",
                         f"The answer is {L}? No. <answer>{W}</answer>"],
        "hedge": [f"<answer>({L}) ({W})</answer>", f"<answer>{L} or {W}</answer>", f"<answer>{W} or {L}</answer>",
                  f"<answer>{L}, {W}</answer>", f"<answer>{L}/{W}</answer>", f"<answer>{L} and {W}</answer>",
                  "<answer>A B C D</answer>", "\\boxed{(A)(B)(C)(D)}", f"<answer>{L}. {W}.</answer>",
                  f"<answer>{L}) or {W})</answer>", f"<answer>Option {L} or option {W}</answer>",
                  f"<answer>either {L} or {W}</answer>", f"\\boxed{{{L} \\text{{ or }} {W}}}",
                  f"<answer>{L}\n{W}</answer>", f"<answer>{L}{W}</answer>",
                  f"<answer>{L}&{W}</answer>", f"<answer>{L}|{W}</answer>",
                  f"\\boxed{{{L} \\lor {W}}}", f"<answer>{L}+{W}</answer>", f"<answer>({L}) {r} ({W}) {o}</answer>",
                  f"<answer>{r} or {o}</answer>", f"<answer>{r}, {o}</answer>", f"\\boxed{{\\{{{r}, {o}\\}}}}",
                  f"<answer>{r} \\pm {o}</answer>"],
        "tags": [f"<answer>{L}</answer> <answer>{W}</answer>", f"\\boxed{{{L}}} <answer>{W}</answer>",
                 f"<answer>{W}</answer> \\boxed{{{L}}}", f"The answer is {L}. <answer>{W}</answer>",
                 f"<answer>{L}</answer><answer>{W}", f"<ANSWER>{L}</ANSWER> <answer>{W}</answer>"],
        "negated": [f"<answer>{L}\u0338</answer>", f"<answer>\\cancel{{{L}}} {W}</answer>",
                    f"<answer>\\phantom{{{L}}}{W}</answer>", f"<answer>\\sout{{{L}}}</answer>",
                    f"<answer>\\not {L}</answer>", f"<answer>\\text{{not }} {L}</answer>",
                    f"<answer>not {L}</answer>",
                    f"<answer>neither {L} nor {W}</answer>", f"<answer>{L} is wrong</answer>",
                    f"<answer>{r} is wrong</answer>", f"<answer>{r} or more</answer>", f"<answer>{r} or less</answer>",
                    f"<answer>not {r}</answer>", f"<answer>{r}, not sure</answer>",
                    f"\\boxed{{{r} \\text{{ or more}}}}", f"The answer is {r} or {rng.choice(['ten', 'so', 'not'])}.",
                    f"<answer>x \\neq {r}</answer>"],
        "unicode": [f"<answer>{cyr[W]}</answer>", f"<answer>{chr(0xFF21 + 'ABCD'.index(W))}</answer>",
                    f"<answer>{W}{rng.choice(ZERO_WIDTH)}</answer>", f"<answer>\u202e{W}</answer>"],
        "100kB": [_junk(rng, 100_000) + f"<answer>{W}</answer>",
                  f"<answer>{L}</answer>" + _junk(rng, 100_000, "abc ABCD()[]{}\n") + f"<answer>{W}</answer>",
                  "<answer>" + "(" * 10_000 + f"{W}</answer>", "\\boxed{" * 20_000 + W,
                  f"<answer>{L} " + "or " * 30_000 + f"{W}</answer>", "<answer>" * 20_000 + W,
                  f"<answer>{'9' * 10_000}</answer>", f"<answer>{'{' * 5_000}{o}{'}' * 5_000}</answer>"],
        "huge": ["<answer>9^9^9^9</answer>", "<answer>10^{10^{10}}</answer>", "\\boxed{\\frac{1}{0}}",
                 "\\boxed{\\sqrt{-1}}", "<answer>1e400</answer>", "<answer>NaN</answer>", "<answer>inf</answer>",
                 "<answer>\\infty</answer>",
                 "\\boxed{\\sqrt[0]{2}}", "<answer>" + "2^" * 50 + "2</answer>"],
    })
    right = [f"<answer>{L}</answer>", f"\\boxed{{{L}}}", f"The answer is {L}.", f"<answer>({L}) {r}</answer>",
             f"<answer>Option {L}</answer>"]
    if isinstance(truth, dict) and truth.get("choices"):
        right.append(f"<answer>{r}</answer>")
    return [Case(x, truth, "wrong", form) for form, x in rng.sample(wrong, 5)] + \
        [Case(rng.choice(right), truth, "right", "control")]


def choice_cases(rng: random.Random, n: int, real_answers: list[dict] | None = None):
    """n hostile cases and their controls (a generator) over real problems (where given) and synthetic ones, each
    judged against the full ground truth, the letter alone, or (for values) the right value alone."""
    real = [p for p in (real_problem(a) for a in real_answers or []) if p is not None]
    return _take(_choice_batches(rng, real), n)


def _choice_batches(rng: random.Random, real: list[Problem]):
    while True:
        p = rng.choice(real) if real and rng.random() < 0.5 else synthetic_problem(rng)
        kind = rng.random()
        if kind < 0.8:
            truth = p.answer()
            out = _choice_letter_cases(rng, p, truth) + _choice_value_cases(rng, p, truth)
        elif kind < 0.9:
            truth = p.letter
            out = _choice_letter_cases(rng, p, truth)
        else:  # the value only: no letters, no choices
            truth = p.choices[p.right]
            out = _choice_value_cases(rng, p, truth)
        yield out
