"""Multiple-choice answers (Geometry3K): the response's final answer is a choice letter or a choice's value.

The final answer is the content of the last <answer>...</answer> (an unclosed last tag runs to the end), else
of the last \\boxed{...} or \\fbox{...} (or of the outermost box around it: "\\boxed{\\boxed{B} or \\boxed{C}}" is
the hedge "B or C", not C), else the rest of the last "answer is ..." / "Answer: ..." line. It is read as
  1. a bare letter ("C", "(C)", "C.", "\\text{C}", "Option C"),
  2. the text of a choice, compared after normalisation (spaces, $, \\left/\\right, degree marks removed),
  3. a letter followed by its value ("C. 15", "(C) 15": the letter counts),
  4. a number: decimals, \\frac{a}{b}, a/b, \\sqrt{x}, \\sqrt[n]{x}, \\pi, implicit products (2\\sqrt{3}),
     powers, degrees (60^\\circ, 60°) and trailing unit words (cm, in^2, units) dropped, other words kept ("15 or
     more" is no number). A mixed number is a sum: "2\\frac{1}{2}", "2 1/2" and Geometry3K's "4 \\frac { 4 } { 11 }"
     are 2.5, 2.5 and 48/11 (digits then \\frac of digits, where they start a value; elsewhere, as in
     "\\sqrt 2 \\frac{1}{2}" or "10^2\\frac{1}{2}", or with an improper fraction, "2\\frac{3}{2}", it is neither a
     clear sum nor a clear product: no number). A relation "x = 15" (=, \\approx, ≈)
     states its value after a leading name (a side that is no number: "x", "m \\angle B"); every other side is a
     value too, so a chain "12 = 10" or "x = 2\\sqrt{3} \\approx 3.46" counts only if EVERY side is right.
     Evaluated by a small recursive-descent parser over a token whitelist (never eval). A number picks the
     single NEAREST choice (by value), and counts only if that choice is unambiguous and close (TOLERANCE):
     a tie between choices of different values is WRONG, so is a number nearer a wrong choice. 12.9 picks
     "12.9" over "13"; 3.46 picks "2 \\sqrt { 3 }".
A final answer that names several different letters ("(A) (B) (C) (D)", "A. B. C. D.", "A) or B)") is a hedge:
WRONG (UNPARSABLE where no letter or right value is known). One letter repeated, or other letters mentioned only
in the reasoning before the final answer, is fine.

TOLERANCE (the rule for "close", in _close). A value x read from the response equals a gold value g when
  - x == g up to float error (1e-9 relative): exact forms, e.g. "\\sqrt{12}" for "2 \\sqrt { 3 }", "120.0" for 120;
  - or the GOLD is written as a decimal with p places ("3.46", "12.9": a rounded value) and x rounds to it,
    |x - g| <= 0.5 * 10^-p: "2\\sqrt{3}" (3.4641...) and "3.464" match gold "3.46", "3.47" does not;
  - or the RESPONSE is a decimal with k >= 2 places that rounds the gold, |x - g| <= 0.5 * 10^-k: "3.46" or
    "3.4641" for gold 2\\sqrt{3}, "0.43" for 3/7 ("3.5" for 2\\sqrt{3} is WRONG: one place is too coarse).
  A degree mark does not change a decimal's places: "9.80^\\circ" is read as "9.80".
  An integer or exact gold (120, 1000, \\frac{3}{7}) thus has no tolerance beyond that: 121 for 120, 1009 for
  1000, 120.5 for 120 are WRONG.

Verdicts: CORRECT when the letter is the right one, or the value picks the right choice (when choices share
the right value, as in a few Geometry3K problems, the value is right whichever of them it names); WRONG for
another letter or value, a hedge, or a value nearest no single right choice; UNPARSABLE when there is no final
answer or nothing in it reads as a letter or value.
Without choices (a value-only ground truth), a value is compared with the truth value alone (TOLERANCE) and a
letter is UNPARSABLE. Input is cut to its last MAX_CHARS characters; verify() never raises.

Ground truth: a letter ("C"), a dict {"letter", "value", "choices"[, "precise_values"]} as built by the
geometry3k task, or a value string (no choices known). A choice's value is read from its TEXT; a precise value is
used only for a choice whose text is no number (Geometry3K's own precise_value misreads its mixed numbers).
"""
from __future__ import annotations

import functools
import logging
import math
import re

from bapo_vl.problem import Verdict

from .latex import final_box, match_brace

log = logging.getLogger(__name__)

MAX_CHARS = 20_000  # the tail of a response that is searched
MAX_SPAN = 300  # longest final answer that is read
MAX_TOKENS = 60  # longest expression the number parser evaluates
TIME_BUDGET = 0.02  # seconds (CPU) one verify() may take on any response: the caps above bound the work, and
# tests/test_verifier_fuzz.py holds it to this on >= 20,000 hostile responses
LETTERS = "ABCD"


# --- the final answer -----------------------------------------------------------------------------------------

_ANSWER_LINE = re.compile(r"\b(?i:answer)\b(?:\s+is)?\s*[:：]?[ \t]*([^\n]*)")


def extract_answer(response: str) -> str | None:
    """The final answer's text (see the module doc), stripped; None when there is none.

    >>> extract_answer("x = 15, so <answer> C </answer>")
    'C'
    >>> extract_answer("so the answer is $2\\\\sqrt{3}$. Done")
    '$2\\\\sqrt{3}$'
    """
    if not isinstance(response, str):
        return None
    text = response[-MAX_CHARS:]
    low = text.lower()
    i = low.rfind("<answer>")
    if i >= 0:
        j = low.find("</answer>", i)
        span = text[i + len("<answer>"):j if j >= 0 else len(text)].strip()
        if span:  # "<answer>The answer is C</answer>" -> "C"
            return _answer_phrase(span[:MAX_SPAN]) or span
    box = final_box(text)  # the last box, or the outermost box around it: "\\boxed{\\boxed{B} or \\boxed{C}}"
    boxed = text[box[1]:box[2]].strip() if box else None
    if boxed:
        return boxed
    return _answer_phrase(text)


def _answer_phrase(text: str) -> str | None:
    """What follows the last "answer is" / "Answer:", up to the end of its sentence: "The answer is 15. I..." -> "15"."""
    found = _ANSWER_LINE.findall(text)
    if found:
        span = re.split(r"\.\s|\s+(?:because|since|as)\s", found[-1], maxsplit=1)[0].strip().rstrip(".")
        return span or None
    return None


# --- reading a final answer -----------------------------------------------------------------------------------

def _unwrap(s: str) -> str:
    """\\text{C} -> C, \\boxed{\\frac{1}{2}} -> \\frac{1}{2} (wrappers removed, their content kept)."""
    for _ in range(8):
        m = re.search(r"\\(?:boxed|textbf|textnormal|text|mathrm|mathbf|fbox)\s*\{", s)
        if not m:
            break
        end = match_brace(s, m.end() - 1)
        if end is None:
            break
        s = s[:m.start()] + s[m.end():end] + s[end + 1:]
    return s


def _clean(span: str) -> str:
    s = _unwrap(span[:MAX_SPAN])
    s = s.replace("$", "").replace("**", "").replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    return s.strip().rstrip(".").strip()


def _bare_letter(s: str, letters: str) -> str | None:
    m = re.fullmatch(r"(?:(?:[Oo]ption|[Cc]hoice)\s*)?\(?\s*([A-Za-z])\s*\)?\s*[.:)]?", s)
    if m and m.group(1).upper() in letters:
        return m.group(1).upper()
    return None


def _letter_prefix(s: str, letters: str) -> str | None:
    m = re.match(r"(?:(?:[Oo]ption|[Cc]hoice)\s*)?(?:\(([A-Z])\)|([A-Z])\s*[.:)])\s*\S", s)
    letter = m and (m.group(1) or m.group(2))
    return letter if letter and letter in letters else None


_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree|\\circ")
_SPACING = re.compile(r"\\left|\\right|\\[,;:! ]|\\displaystyle")


def normalize(text) -> str:
    """Text of a value for string comparison: no spaces, $, \\left/\\right, degree marks; \\dfrac -> \\frac."""
    return _normalize(str(text)[:MAX_SPAN])


@functools.lru_cache(maxsize=8192)  # choices are normalised at every verify() call
def _normalize(text: str) -> str:
    s = _clean(text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _SPACING.sub("", s)
    s = _DEGREES.sub("", s)
    return re.sub(r"\s+", "", s).lower()


# --- numbers --------------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\d+(?:\.\d*)?|\.\d+|\\sqrt|\\frac|\\pi|\\cdot|\\times|\\div|[-+*/^(){}\[\]:]")
_MULT = {"*", "\\cdot", "\\times"}
_DIV = {"/", "\\div", ":"}


def _tokens(s: str) -> list[str] | None:
    out, pos = [], 0
    s = s.strip()
    while pos < len(s):
        if s[pos].isspace():
            pos += 1
            continue
        m = _TOKEN.match(s, pos)
        if not m:
            return None
        out.append(m.group())
        pos = m.end()
        if len(out) > MAX_TOKENS:
            return None
    return out


class _Parser:
    """expr := term (+|- term)*; term := unary ((*|/) unary | implicit primary)*; unary := (+|-) unary | power;
    power := primary (^ unary)?; primary := number | \\pi | \\sqrt[n]{x} | \\frac{a}{b} | (expr) | {expr}."""

    def __init__(self, tokens: list[str]):
        self.t, self.i = tokens, 0

    def peek(self):
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self):
        tok = self.peek()
        if tok is None:
            raise ValueError("unexpected end")
        self.i += 1
        return tok

    def expect(self, tok):
        if self.take() != tok:
            raise ValueError(f"expected {tok}")

    def expr(self) -> float:
        v = self.term()
        while self.peek() in ("+", "-"):
            v = v + self.term() if self.take() == "+" else v - self.term()
        return v

    def term(self) -> float:
        v = self.unary()
        while True:
            tok = self.peek()
            if tok in _MULT or tok in _DIV:
                self.take()
                w = self.unary()
                v = v * w if tok in _MULT else v / w
            elif tok in ("\\sqrt", "\\frac", "\\pi", "(", "{"):  # 2\sqrt{3}, 3\pi, 2(x): implicit product
                v = v * self.power()
            else:
                return v

    def unary(self) -> float:
        if self.peek() in ("+", "-"):
            return -self.unary() if self.take() == "-" else self.unary()
        return self.power()

    def power(self) -> float:
        base = self.primary()
        if self.peek() == "^":
            self.take()
            exp = self.unary()
            if abs(exp) > 12 or abs(base) > 1e6:
                raise ValueError("power out of range")
            return math.pow(base, exp)
        return base

    def primary(self) -> float:
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            return float(tok)
        if tok == "\\pi":
            return math.pi
        if tok in ("(", "{"):
            v = self.expr()
            self.expect(")" if tok == "(" else "}")
            return v
        if tok == "\\sqrt":
            n = 2.0
            if self.peek() == "[":
                self.take()
                n = self.expr()
                self.expect("]")
            x = self.primary()
            if x < 0 or n <= 0 or n > 12:
                raise ValueError("bad root")
            return math.pow(x, 1.0 / n)
        if tok == "\\frac":
            a = self.primary()
            return a / self.primary()
        raise ValueError(f"unexpected {tok}")


# a mixed number: digits, then \frac of digits ("4 \frac { 4 } { 11 }"), or, as the whole value, digits then a/b
# ("2 1/2")
_MIXED = re.compile(r"(\d+)\s*\\frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_MIXED_SLASH = re.compile(r"\s*[-+]?\s*(\d+)\s+(\d+)\s*/\s*(\d+)\s*")
_STARTS_A_VALUE = re.compile(r"(?:^|[-([{+*/=,;:]|\\cdot|\\times|\\div)\s*$")  # what may stand before one


def _mixed_numbers(s: str) -> str:
    """Each mixed number as one fraction in braces: "4 \\frac{4}{11}" -> "{\\frac{48}{11}}", "-2 1/2" ->
    "-{\\frac{5}{2}}". Where it is unclear, ValueError (no number): digits and \\frac that do not start a value
    ("\\sqrt 2 \\frac{1}{2}", "10^2\\frac{1}{2}", "1.5\\frac{1}{2}"), or an improper fraction after the digits
    ("2\\frac{3}{2}": 3.5 or 3?)."""
    def one(whole: str, num: str, den: str) -> str:
        if int(num) >= int(den):
            raise ValueError("a whole number before an improper fraction")
        return f"{{\\frac{{{int(whole) * int(den) + int(num)}}}{{{den}}}}}"

    m = _MIXED_SLASH.fullmatch(s)
    if m:
        return s[:m.start(1)] + one(*m.groups())

    def replace(m: re.Match) -> str:
        if not _STARTS_A_VALUE.search(s, 0, m.start()):
            raise ValueError("digits and a fraction that do not start a value")
        return one(*m.groups())

    return _MIXED.sub(replace, s)


def parse_number(text: str) -> float | None:
    """The value of a small LaTeX/plain arithmetic expression, or None (never raises, never evals).

    >>> round(parse_number("2 \\\\sqrt { 3 }"), 4), parse_number("60^\\\\circ"), parse_number("\\\\frac{3}{4}")
    (3.4641, 60.0, 0.75)
    """
    if not isinstance(text, str) or len(text) > MAX_SPAN:
        return None
    return _parse_number(text)


@functools.lru_cache(maxsize=8192)  # choices are evaluated at every verify() call
def _parse_number(text: str) -> float | None:
    try:
        s = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("√", "\\sqrt ")
        s = s.replace("π", "\\pi ").replace("×", "*").replace("÷", "/").replace("−", "-").replace("$", "")
        s = re.sub(r"(?<![\\a-zA-Z])sqrt", "\\\\sqrt", s)
        s = _SPACING.sub(" ", s)
        s = _DEGREES.sub("", s)
        s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # 1,000
        s = _mixed_numbers(s)
        tokens = _tokens(s)
        if not tokens:
            return None
        parser = _Parser(tokens)
        value = parser.expr()
        if parser.peek() is not None or not math.isfinite(value):
            return None
        return float(value)
    except (ValueError, ZeroDivisionError, OverflowError, TypeError, RecursionError):
        return None


# trailing unit words (as in Geometry3K: cm, in^2, units, degrees...), and only those: "15 or more", "15 is wrong"
# and "15 or sixteen" are not 15
_UNIT = (r"(?:square\s+|sq\.?\s*|cubic\s+)?(?:units?|[ckm]?m|km|meters?|metres?|centimeters?|millimeters?|"
         r"kilometers?|in|inch(?:es)?|ft|feet|foot|yd|yards?|mi|miles?|degrees?|deg|radians?|rad)(?![a-zA-Z])")
_UNITS = re.compile(rf"(?:\s*(?<![\\a-zA-Z]){_UNIT}\.?(?:\s*\^\s*\{{?\d\}}?)?)+\s*$", re.I)


_RELATION = re.compile(r"(?<![<>!])=+|\\approx(?![a-zA-Z])|≈")  # not "<=", "!=": those state no value


def _side_number(s: str) -> tuple[float | None, str]:
    """(value, the text it was read from) of one side of a final answer, e.g. "15 cm" -> 15."""
    s = s.strip().rstrip(".").strip()
    value = parse_number(s)
    if value is None:
        stripped = _UNITS.sub("", s)
        if stripped != s and stripped.strip():
            s = stripped.strip()
            value = parse_number(s)
    return value, s


def _response_numbers(s: str) -> list[tuple[float | None, str]]:
    """(value, text) of each value a final answer states: "x = 15 cm" -> [(15, "15")], "12 = 10" -> two values, a
    chain that must be right in every side. A leading side that is no number names what is asked ("x", "m \\angle
    B", "SR") and is dropped."""
    sides = [_side_number(side) for side in _RELATION.split(_unwrap(s))]
    if len(sides) > 1 and sides[0][0] is None:
        sides = sides[1:]
    return sides


def _places(text) -> int | None:
    """Decimal places of a plain decimal ("3.46" -> 2, "-0.5" -> 1, "9.80^\\circ" -> 2); None for anything else
    (integers, forms)."""
    m = re.fullmatch(r"[-+]?\d*\.(\d+)", _DEGREES.sub("", str(text)).strip().replace(" ", ""))
    return len(m.group(1)) if m else None


def _close(x: float, truth: float, text: str, truth_text=None) -> bool:
    """Whether the response's value x (read from `text`) is the truth value (written `truth_text`); see TOLERANCE."""
    if abs(x - truth) <= 1e-9 * max(1.0, abs(truth)):  # the same number (2\sqrt{3} == \sqrt{12})
        return True
    gold = _places(truth_text) if truth_text is not None else None
    if gold is not None and abs(x - truth) <= 0.5 * 10 ** -gold + 1e-9:  # x rounds to the gold's decimals
        return True
    mine = _places(text)  # the response rounded the truth to >= 2 decimals (3.46 for 2\sqrt{3})
    return mine is not None and mine >= 2 and abs(x - truth) <= 0.5 * 10 ** -mine + 1e-9


# --- ground truth ---------------------------------------------------------------------------------------------

def choice_values(choices: list, precise_values: list | None = None) -> list[float | None]:
    """Each choice's number: its text evaluated, else its precise value, else None (text-only choices)."""
    out = []
    for i, choice in enumerate(choices):
        v = parse_number(choice) if isinstance(choice, str) else None
        if v is None and precise_values and i < len(precise_values):
            p = precise_values[i]
            v = float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) and math.isfinite(p) else None
        out.append(v)
    return out


def _truth(answer, letters: str):
    """(letter, value, choices, precise_values) of a ground truth."""
    if isinstance(answer, dict):
        letter = answer.get("letter")
        letter = letter.strip().upper() if isinstance(letter, str) and letter.strip() else None
        choices = answer.get("choices") or None
        value = answer.get("value")
        if value is None and letter in letters and choices and letters.index(letter) < len(choices):
            value = choices[letters.index(letter)]
        return letter, value, choices, answer.get("precise_values")
    if isinstance(answer, str) and _bare_letter(answer.strip(), letters):
        return answer.strip().upper(), None, None, None
    return None, (None if answer is None else str(answer)), None, None


def _pick_by_value(s: str, choices: list, numbers: list) -> set[int] | None:
    """Indices of the choices the value `s` names: by text, else by the nearest number to each value it states (a
    chain "12 = 10" names the choices of all its sides); None if it reads as no value."""
    key = normalize(s)
    hits = {i for i, c in enumerate(choices) if isinstance(c, str) and normalize(c) == key}
    if hits:
        return hits
    sides = _response_numbers(s)
    if any(x is None for x, _ in sides):
        return None
    known = [(i, v) for i, v in enumerate(numbers) if v is not None]
    if not known:
        return set()
    picked = set()
    for x, text in sides:
        best = min(abs(x - v) for _, v in known)
        nearest = {i for i, v in known if abs(x - v) <= best + 1e-9 * max(1.0, abs(v))}
        # every nearest choice must be close by the rule (a tie between different values is judged by the caller)
        if not all(_close(x, numbers[i], text, choices[i]) for i in nearest):
            return set()
        picked |= nearest
    return picked


_NAMED = re.compile(r"\(\s*([A-Z])\s*\)|(?<![A-Za-z\\])([A-Z])\s*(?:[.:)](?!\d)|$)"
                    r"|(?i:option|choice)\s*\(?([A-Za-z])\b")


# a final answer that is a list of bare letters: "B or C", "B, C", "B/C", "either B or C" (what
# "\\boxed{\\boxed{B} or \\boxed{C}}" reads as); not a choice's text such as "A D and B E"
_LISTED = re.compile(r"(?:either\s+|both\s+)?[A-Z](?:\s*(?:,|/|&|\||\bor\b|\band\b|\bnor\b)\s*[A-Z])+")


def _letters_named(s: str, letters: str) -> set[str]:
    """The choice letters a final answer names as letters: "(A) (B)", "A. B.", "A) or B)", "B or C", "Option A" ..."""
    named = {m.group(1) or m.group(2) or m.group(3).upper() for m in _NAMED.finditer(s)}
    if _LISTED.fullmatch(s):
        named |= set(re.findall(r"\b[A-Z]\b", s))
    return named & set(letters)


# --- verdicts -------------------------------------------------------------------------------------------------

def extract_choice(response: str, letters: str = LETTERS) -> str | None:
    """The choice letter stated as the final answer, or None.

    >>> extract_choice("so x = 15. <answer>C</answer>")
    'C'
    """
    span = extract_answer(response)
    if span is None:
        return None
    s = _clean(span)
    if len(_letters_named(s, letters)) > 1:  # a hedge: "(A) (B) (C) (D)"
        return None
    return _bare_letter(s, letters) or _letter_prefix(s, letters)


def _verify(response: str, answer, letters: str) -> Verdict:
    span = extract_answer(response)
    if span is None:
        return Verdict.UNPARSABLE
    s = _clean(span)
    if not s:
        return Verdict.UNPARSABLE
    letter, value, choices, precise = _truth(answer, letters)
    numbers = choice_values(choices, precise) if choices else []
    right: set[int] = set()  # indices of the right choice(s)
    if choices:
        if letter in letters and letters.index(letter) < len(choices):
            right.add(letters.index(letter))
        if value is not None:  # choices sharing the right value count as right (a few Geometry3K problems)
            key, v_right = normalize(value), parse_number(str(value))
            right |= {i for i, c in enumerate(choices) if isinstance(c, str) and normalize(c) == key}
            if right and numbers[min(right)] is not None:
                v_right = numbers[min(right)]
            if v_right is not None:
                right |= {i for i, v in enumerate(numbers)
                          if v is not None and abs(v - v_right) <= 1e-9 * max(1.0, abs(v))}

    def by_letter(chosen: str) -> Verdict:
        if letter is not None:
            return Verdict.CORRECT if chosen == letter else Verdict.WRONG
        if right:  # no letter given, but the right value is among the choices
            return Verdict.CORRECT if letters.index(chosen) in right else Verdict.WRONG
        return Verdict.UNPARSABLE  # a letter, but no letter is known for this problem

    chosen = _bare_letter(s, letters)
    if chosen:
        return by_letter(chosen)
    if len(_letters_named(s, letters)) > 1:  # a hedge naming several letters is no single answer
        return Verdict.WRONG if (letter is not None or right) else Verdict.UNPARSABLE
    if choices:
        hits = _pick_by_value(s, choices, numbers)
        if hits:  # every nearest choice must be right: a tie with a wrong choice is WRONG
            return Verdict.CORRECT if hits <= right else Verdict.WRONG
        chosen = _letter_prefix(s, letters)
        if chosen:
            return by_letter(chosen)
        if hits is not None:
            return Verdict.WRONG  # a number near no choice
        return Verdict.WRONG if any(v is None for v in numbers) else Verdict.UNPARSABLE
    # no choices known: compare with the truth value
    chosen = _letter_prefix(s, letters)
    if chosen:
        return by_letter(chosen)
    if value is None:
        return Verdict.UNPARSABLE
    if normalize(s) == normalize(value):
        return Verdict.CORRECT
    truth = parse_number(str(value))
    right = True
    for x, text in _response_numbers(s):  # every side of a chain must be the value
        if normalize(text) == normalize(value):
            continue
        if x is None:
            return Verdict.WRONG if truth is None else Verdict.UNPARSABLE
        right = right and truth is not None and _close(x, truth, text, _clean(str(value)))
    return Verdict.CORRECT if right else Verdict.WRONG


def verify(response: str, answer, letters: str = LETTERS) -> Verdict:
    """CORRECT / WRONG / UNPARSABLE of `response` against a letter, a geometry3k answer dict or a value."""
    try:
        if not isinstance(response, str):
            return Verdict.UNPARSABLE
        return _verify(response, answer, letters)
    except Exception as e:  # noqa: BLE001 - model output is hostile input; a verifier must not crash training
        log.warning("choice verifier raised %s: %s", type(e).__name__, e)
        return Verdict.UNPARSABLE
