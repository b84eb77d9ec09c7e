"""Math answers: extract the final answer of a response and decide whether it equals the reference.

Extraction (extract_answer): the last box (the outermost one around it when boxes nest, so
"\\boxed{\\boxed{5} \\text{ or } \\boxed{6}}" is a hedge, not 6), else <answer> tags, else the last "answer is" /
"Answer:" (so "$5$ is incorrect; the correct answer is $6$" gives 6). Prose that takes the value back or
qualifies it ("the answer is not $5$", "at least $5$", "anything but $5$", "$5$? No.", "\\boxed{5} is wrong") makes
the response UNPARSABLE: such a response never counts as the value it rejects.
Checks go cheapest first, all but the last in this process:
  (a) normalised strings (LaTeX spacing, \\dfrac, \\left/\\right, units, degrees, percent, "x=" and "(x,y)=",
      thousands separators, \\frac12, \\sqrt2, \\binom52, {5 \\choose 2}, √196 = \\sqrt{196}, 5² -> 5^{2},
      \\$36 -> 36, \\log_e -> \\ln, \\mathbb{R} -> (-\\infty,\\infty), \\phantom{..} dropped, ...); degrees inside
      trig are converted (\\sin 30^\\circ = 1/2), elsewhere the unit is dropped; "a \\quad b", "a \\lor b", a line
      break "a \\\\ b" outside a matrix and "\\text{ (or }" are item separators (a list, not a product);
  (b) structure (intervals, tuples, unordered sets/lists, unions, matrices, "a \\pm b") and the exact value of
      each element from a small bounded evaluator: Fractions for rationals (so 1/2004! != 1/2006!), complex
      floats once sqrt, pi or i appear; every power, factorial and intermediate result is capped in size, so
      power towers and 1000000! are refused (WRONG) at once. Exact answers are compared exactly: floats that
      differ (beyond DISTINCT_REL_TOL) are WRONG, floats that agree go to sympy for an exact check (355/113 !=
      pi, 3.1415926535897 != pi). The relative tolerance NUMERIC_REL_TOL applies ONLY where the gold answer is
      itself a decimal approximation (has a decimal point, e.g. "3.14159"), and then to rational responses too
      (1.4142136 for 1.414214). \\sqrt[n]{x} of a negative x and odd n is the real root (\\sqrt[3]{-8} = -2); i is
      the imaginary unit, in sympy too (e^{i\\pi} = -1). A numeral with a subscript (52_8, 86_{87+0}) is
      compared as written, never as the number without it. Words in \\text{} are kept
      unless they are unit words (5 \\text{ million} != 5); a relation chain "x=3=5" (\\approx and \\equiv are
      "=" too) must agree in every side; a mixed number 1\\frac{1}{2} is 3/2, also as an item or a chain side;
      several different choice labels ("(A) (B) (C)") are a hedge, WRONG; 0.\\overline{3} = 1/3; \\Gamma(n) and
      \\binom{n}{k} of integers are exact (capped like factorials); a decimal gold's tolerance holds for the real
      and imaginary parts apart (5e10 + i is not 5e10);
  (c) expressions in variables are evaluated exactly at two fixed rational points: different values there
      mean WRONG at once (equal values prove nothing and go on);
  (d) only what is still open (x^2-1 = (x-1)(x+1), trig identities, equations, inequalities vs intervals)
      goes to math-verify/sympy, in ONE call to a killable worker process (verifiers.sandbox) under
      SYMBOLIC_TIMEOUT seconds of its CPU time (closed algebraic forms are decided exactly by their minimal
      polynomial, sums with explicit bounds by evaluating them), after a screen that keeps huge exponents,
      factorials, literals, deep nesting and malformed input away from sympy, and anything sympy's lenient parser
      would guess at: non-ASCII characters (a digit with a combining stroke), LaTeX commands outside
      _KNOWN_COMMANDS (\\tag, \\footnote, \\not, \\cancel, \\color, ...), empty items ("(,") and numbers like "1.2.3"
      are WRONG; math-verify reads LaTeX only (its fallback to plain expressions found the 5 in "5 \\sum 6").
      There, too, two-point evaluation runs before math-verify, and it overrules math-verify's 6-decimal
      rounding (which accepted 1/2004! for 1/2006!).
Time: a verdict depends on the response and the gold alone, not on the load of the host nor on the other
responses of a batch. The in-process checks of one response take at most TIME_BUDGET seconds of CPU, whatever it
holds (the caps bound them; tests/test_verifier_fuzz.py holds >= 20,000 hostile responses to it). The symbolic
check of one response may use SYMBOLIC_TIMEOUT seconds of CPU time of its worker, counted by the kernel for that
worker and that call alone (verifiers.sandbox); past it the worker is ended (TIMEOUT) and replaced in the
background. There is no batch deadline: verify_batch spreads the checks over SANDBOX_WORKERS workers, so a slow
response delays the batch but never changes a neighbour's verdict. SYMBOLIC_WALL_LIMIT (wall clock, many times
the CPU limit) only ends a worker that hangs without computing; a slow answer on a busy host does not reach it.
Verdicts: UNPARSABLE when no final answer can be extracted, TIMEOUT when the symbolic check exceeds its CPU
limit or its worker dies (or hangs), else CORRECT/WRONG. `verify` never raises. Nothing from the response is
ever eval'ed.
"""
from __future__ import annotations

import cmath
import functools
import logging
import math
import os
import re
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

from bapo_vl.problem import Verdict

from . import sandbox
from .latex import final_box, last_boxed, match_brace

VERIFIER_VERSION = "math-1.3"  # bump when a response could be judged differently
log = logging.getLogger(__name__)
MAX_RESPONSE_CHARS = 10_000  # only the tail of a response is searched for the answer
MAX_ANSWER_CHARS = 1_000  # a longer extracted answer counts as unparsable
SYMBOLIC_TIMEOUT = 5.0  # seconds of worker CPU time per response for the sandboxed symbolic check
SYMBOLIC_WALL_LIMIT = 120.0  # wall seconds after which a symbolic check's worker counts as hung (see "Time")
TIME_BUDGET = 0.1  # seconds (CPU) of the in-process checks of one response (see "Time" above)
SANDBOX_WORKERS = max(2, min(8, os.cpu_count() or 1))  # parallel symbolic checks (no verdict depends on it)
SANDBOX_MEMORY_MB = 3072  # address-space cap of a sandbox worker
NUMERIC_REL_TOL = 1e-6  # only where the GOLD answer is itself a decimal approximation ("3.14159")
# Exact answers (no decimal point in the gold) are compared exactly: rationals as Fractions; values with roots,
# pi or i are called different in-process when their floats differ by more than DISTINCT_REL_TOL (far above
# double rounding error), and otherwise go to the symbolic (sympy) check, so 355/113 != pi, 2024 !=
# sqrt(2024^2+1) and sqrt(N) != sqrt(N+1).
DISTINCT_REL_TOL = 1e-12
MAX_DEPTH = 40  # bracket nesting / evaluator recursion
MAX_BITS = 40_000  # numerator/denominator size of exact values (about 12,000 digits)
MAX_FACTORIAL = 3_000
MAX_SET_SIZE = 32
# for the symbolic step only
SYMBOLIC_MAX_CHARS = 400
SYMBOLIC_MAX_DEPTH = 12
SYMBOLIC_MAX_EXPONENT = 1_000
SYMBOLIC_MAX_DIGITS = 60


# ---------------------------------------------------------------- extraction

# "the answer is" / "Answer:", its answer on the line that follows
_FINAL = re.compile(r"answer(?:\*\*)?\s*(?:is\b\s*[:：]?|[:：=])\s*(?:\*\*)?[ \t]*(?=[^\s])", re.I)
# a math span; "\$" inside one is a dollar sign ("$\$36$"), not its end
_MATH_SPAN = re.compile(r"(?<!\\)\$\$?((?:\\.|[^$\\])+?)\$\$?|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)

# Prose that takes back or qualifies the value beside it: "the answer is not $5$", "at least $5$", "anything but
# $5$", "$5$ is incorrect", "$5$? No.", "$5$ or more", "x \ne \boxed{5}". Such an answer is no answer (UNPARSABLE):
# it must never count as the value it rejects. Wider than needed on purpose: a hedge may lose its reward.
_NEG_WORDS = (r"not|no|never|none|nor|neither|cannot|isn['’]t|aren['’]t|wasn['’]t|incorrect|wrong|false|anything|"
              r"everything|except|but|other|unless|least|most|more|less|fewer|greater|smaller|larger|bigger|higher|"
              r"lower|above|below|over|under|approx\w*|about|around|roughly|nearly|almost|maybe|perhaps|possibly|"
              r"probably|likely|either|between|instead|rather|excluding|besides|beyond|up\s+to|guess\w*|might|may|"
              r"could|if|assum\w*|suppos\w*")
_NEG = (rf"(?<![a-z])(?:{_NEG_WORDS})(?![a-z])|n['’]t(?![a-z])"
        r"|\\(?:neq?|not|geq?|leq?|gtr?|lt|approx|sim)(?![a-z])|[<>≠≥≤≈]")
_NEGATING = re.compile(_NEG + "|[?]", re.I)  # anywhere in the words between "the answer is" and its value
_NEGATING_END = re.compile(  # at the end of the clause before a box: "is not \boxed{5}", "\boxed{5} or \boxed{6}"
    rf"(?:{_NEG}|(?<![a-z])or)"
    r"(?:\s|[=:${}]|\\[(\[]|(?<![a-z])(?:equal|equals|to|be|is|exactly|precisely|than)(?![a-z]))*$", re.I)
_CORRECTION = (r"(?<![a-z])(?:actually|wait|hmm+|oops|sorry|correction|nope|just\s+kidding|kidding|joking|i\s+mean|"
               r"scratch|oh|hold\s+on)(?![a-z])")  # "$5$. Actually, it's $6$."
_NEGATING_START = re.compile(  # at the start of what follows a value: "? No", " is incorrect", " or more", ". Wait"
    rf"^[\s,;:.…(—–-]*(?:\?|~~|</?(?:del|s|strike)>|(?:(?:is|are|was|were|would\s+be|seems|must\s+be)\s+)?"
    rf"(?:{_NEG}|{_CORRECTION}|or\s+(?!\$|\\[(\[])))", re.I)
_STRUCK = re.compile(r"~~[^~]*~~|<(del|s|strike)>.*?</\1>", re.I | re.S)  # struck out (markdown, HTML): not an answer
# "$5$, not $6$", "\boxed{5}, not 6": rejecting another value
_OTHER_VALUE = re.compile(r"(?<![a-z])(?:not|rather\s+than|instead\s+of)\s*(?=\$|\\[(\[]|\\boxed|[-−]?\d)", re.I)
_RETRACTION = re.compile(  # soon after the answer: "\boxed{5}. Wait, that's wrong" (not "a common mistake is ...")
    r"(?<![a-z])(?:(?:that|this|it|which)(?:['’]s|\s+is|\s+was)\s+(?:wrong|incorrect|a\s+mistake|mistaken|"
    r"not\s+(?:right|correct|the\s+answer))|scratch\s+that|I\s+made\s+a\s+mistake)(?![a-z])", re.I)


_TAG = re.compile(r"</?[a-zA-Z]+>")  # <answer>, </answer>: not relations
_TAG_END = re.compile(r"</?(?:answer|think|p|b|strong|em|br|div|span)>", re.I)  # (but "<del>" after a value is)


def _disowned_after(after: str) -> bool:
    """Does the text after an answer take it back ("? No", " is incorrect", "that's wrong" soon after) or
    qualify it (" or more", " at least")?"""
    after = re.sub(r"^(?:\s|\$|\\[)\]])*", "", after[:300])
    return bool(_NEGATING_START.search(_OTHER_VALUE.sub(" ", _TAG_END.sub(" ", after[:200])))
                or _RETRACTION.search(after))


def _disowned_box(text: str, start: int, end: int) -> bool:
    """Is the box text[start:end] (its command to its closing brace) negated or qualified by the prose around it?
    Only the clause just before it counts there ("Since no root is real, the answer is \\boxed{5}" is fine)."""
    before = text[max(0, start - 200):start]
    if re.search(r"(?:~~|<(?:del|s|strike)>)[\s$]*$", before, re.I):  # struck out
        return True
    before = re.split(r"[,;:!?\n]|\.\s", _TAG.sub(" ", before))[-1]
    return bool(_NEGATING_END.search(before)) or _disowned_after(text[end:])


def _clean_final(text: str) -> str | None:
    """The answer part of what follows "Answer:" / "the answer is" on its line; None when the prose around the
    value takes it back or qualifies it (see _NEG_WORDS)."""
    text = _STRUCK.sub(" ", text).strip().strip("*").strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    spans = list(_MATH_SPAN.finditer(text))
    if spans:  # the first math span, with any that follow it joined by ",", "and", "or"
        if _NEGATING.search(_TAG.sub(" ", text[:spans[0].start()])):
            return None
        parts, end = [], spans[0].start()
        for m in spans:
            if not re.fullmatch(r"\s*(?:,|;)?\s*(?:(?:and|or)\s*)?", text[end:m.start()]):
                break
            parts.append(next(g for g in m.groups() if g is not None))
            end = m.end()
        return None if _disowned_after(text[end:]) else ",".join(parts)
    m = re.match(r"(.*?)(?:\.\s|\.?$)", text)  # up to the end of the sentence ("13. I hope it is correct")
    return m.group(1) if m else text


def _last_final(text: str) -> str | None:
    """The answer after the last "Answer:" / "the answer is" (so "$5$ is incorrect; the correct answer is $6$"
    gives 6), read by _clean_final; None if there is none."""
    final = deque(_FINAL.finditer(text), maxlen=1)
    if not final:
        return None
    start = final[0].end()
    stop = text.find("\n", start)
    return _clean_final(text[start:stop if stop >= 0 else len(text)]) or None


def extract_answer(response: str) -> str | None:
    """The final answer: the last \\boxed{...}/\\fbox{...} (the outermost one around it if it sits in another),
    else the last <answer>...</answer>, else the last "Answer: ..." / "The answer is ..." line; None if there is
    none, if it is longer than MAX_ANSWER_CHARS, or if the prose around it takes it back or qualifies it
    ("the answer is not $5$", "at least $5$", "\\boxed{5} is incorrect").

    >>> extract_answer("so the result is 13.\\n\\nAnswer: $13$")
    '13'
    """
    if not isinstance(response, str):
        return None
    text = response[-MAX_RESPONSE_CHARS:].replace("\x00", "")
    box = final_box(text)
    if box is not None:
        end = box[2] + (text[box[2]:box[2] + 1] == "}" and text[box[1] - 1:box[1]] == "{")
        if _disowned_box(text, box[0], end):
            return None
        found = text[box[1]:box[2]]
    else:
        found = None
        end = text.rfind("</answer>")
        start = text.rfind("<answer>", 0, end if end >= 0 else len(text))
        if start >= 0:
            found = text[start + len("<answer>"):end if end >= 0 else len(text)]
            if _FINAL.search(found):
                found = _last_final(found)
            elif "$" in found:
                found = _clean_final(found)
            if found is None:
                return None
    if found is None:
        found = _last_final(text)
    if found is None:
        return None
    found = found.strip()
    if not found or len(found) > MAX_ANSWER_CHARS:
        return None
    return found


# ---------------------------------------------------------------- normalisation

_UNICODE = {"−": "-", "–": "-", "—": "-", "×": "\\times ", "÷": "\\div ", "·": "\\cdot ", "⋅": "\\cdot ",
            "π": "\\pi ", "√": "\\sqrt ", "∛": "\\sqrt[3] ", "∜": "\\sqrt[4] ", "∞": "\\infty ",
            "°": "^\\circ", "≤": "\\le ", "≥": "\\ge ",
            "≠": "\\ne ", "∪": "\\cup ", "∈": "\\in ", "\u00a0": " ", "\u2009": " ", "\u202f": " ", "，": ",",
            "±": "\\pm ", "∓": "\\mp ", "∩": "\\cap ", "∅": "\\emptyset ", "≈": "\\approx ", "…": "\\ldots ",
            "→": "\\to ", "∠": "\\angle ", "θ": "\\theta ", "α": "\\alpha ", "β": "\\beta ", "λ": "\\lambda ",
            "ω": "\\omega ", "φ": "\\phi ", "Δ": "\\Delta "}  # the rest of non-ASCII never reaches sympy
# √196 is the root of 196 (while \sqrt196 in LaTeX is \sqrt{1}96)
_UNICODE_ROOT = re.compile(r"([√∛∜])\s*(\d+(?:\.\d+)?)")
_ROOT_COMMAND = {"√": "\\sqrt", "∛": "\\sqrt[3]", "∜": "\\sqrt[4]"}
_SUPERSCRIPT_DIGITS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺", "0123456789-+")
_SUBSCRIPT_DIGITS = str.maketrans("₀₁₂₃₄₅₆₇₈₉₋₊", "0123456789-+")
_SUPERSCRIPTS = re.compile("[⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺]+")
_SUBSCRIPTS = re.compile("[₀₁₂₃₄₅₆₇₈₉₋₊]+")
_PHANTOM = re.compile(r"\\[hv]?phantom\s*(?:\{[^{}]*\}|\\[a-zA-Z]+|[^{\s])")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|textup|mbox|mathrm|mathbf|mathit|mathsf|"
                       r"mathbb|operatorname|boldsymbol|bm|hbox)\s*\{")
_UNITS = (r"(?:square\s+|sq\.?\s+|cubic\s+)?(?:units?|cm|mm|km|m|meters?|metres?|centimeters?|kilometers?|inch(?:es)?|"
          r"in|feet|foot|ft|yards?|yd|miles?|mi|degrees?|deg|radians?|rad|dollars?|cents?|hours?|hrs?|minutes?|mins?|"
          r"seconds?|secs?|s|h|days?|weeks?|months?|years?|mph|kph|pounds?|lbs?|ounces?|oz|grams?|g|kg|liters?|litres?|"
          r"ml|gallons?|people|persons?|students?|ways|times|points?|coins?|marbles?|books?|pages?|percent)")
_UNIT_TEXT = re.compile(rf"\s*{_UNITS}(?:\s*(?:/|per)\s*{_UNITS})?\s*\.?\s*", re.I)
_TRAILING_UNIT = re.compile(rf"(?<=[\d}}])\s+(?=[a-zA-Z]{{2}}){_UNITS}(?:\s*(?:/|per)\s*{_UNITS})?"
                            r"(?:\^\{?[23]\}?)?\s*\.?$", re.I)
_SIZING = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|Biggl|Biggr|big|Big|bigg|Bigg)(?![a-zA-Z])")
_SPACING = re.compile(r"\\\\|\\[,:;>! ]|\\q?quad(?![a-zA-Z])|\\(?:displaystyle|textstyle|limits)(?![a-zA-Z])|~")
_TOKEN = re.compile(r"\\[a-zA-Z]+|\\.|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|.", re.S)
_FUNCTION = re.compile(r"(?<![\\a-zA-Z])(arcsin|arccos|arctan|sinh|cosh|tanh|sin|cos|tan|cot|sec|csc|log|ln|exp|sqrt)"
                       r"(?![a-zA-Z])")
_LABEL = re.compile(r"\\(?:textbf|text|mathrm|mathbf|mbox|textrm)\s*\{\s*\(\s*([A-E])\s*\)\s*(?:\\[ ,;:!]|~|\s)*\}"
                    r"|\\(?:textbf|text)\s*\{\s*([A-E])\s*\}"
                    r"|\(\s*\\(?:textbf|text|mathrm|mathbf)\s*\{\s*([A-E])\s*\}\s*\)"
                    r"|^\s*\(([A-E])\)(?=\s*\S)"
                    r"|(?P<open>\\(?:textbf|text|mathrm)\s*\{)\s*\(([A-E])\)(?=(?:\\[ ,;:!]|~|\s)*[^\s}\\~])")
_VAR_PREFIX = re.compile(r"[a-zA-Z](?:_\{?[a-zA-Z0-9]+\}?)?(?:\([a-zA-Z]\))?(?:=|\\in(?![a-zA-Z]))")
_TUPLE_PREFIX = re.compile(  # "(x,y)=" before a tuple
    r"\((?:[a-zA-Z](?:_\{?[a-zA-Z0-9]+\}?)?,)+[a-zA-Z](?:_\{?[a-zA-Z0-9]+\}?)?\)=(?=[(\[])")
_REALS = re.compile(r"\\mathbb\s*\{\s*R\s*\}|\\mathbb\s*R(?![a-zA-Z])|ℝ|\\R(?![a-zA-Z])|\\reals(?![a-zA-Z])"
                    r"|^\s*(?:\\text\s*\{\s*)?all\s+real\s+numbers\s*\}?\s*$", re.I)
_TRIG = re.compile(r"(?<![a-zA-Z])(?:sin|cos|tan|cot|sec|csc)(?![a-zA-Z])")
_DEGREES = re.compile(
    r"(\d+(?:\.\d+)?)\s*(?:\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z]))")
# \log_b a: the base is one character or a braced group (as TeX reads it), the argument a number, letter or group
_LOG_BASE = re.compile(r"\\log_\s*(\{[^{}]*\}|[0-9a-zA-Z])\s*(\d+(?:\.\d+)?|[a-zA-Z](?![a-zA-Z])|\{[^{}]*\})")


def _choice_letter(s: str) -> str | None:
    """The letter of the last multiple-choice label ("\\textbf{(C)}", "\\text{(C)}", "(\\text{C})", "(C) ...")."""
    found = [next(g for g in m.groups() if g) for m in _LABEL.finditer(s)]
    return found[-1] if found else None


def _drop_choice_label(s: str) -> str:
    """"\\textbf{(C)}\\ 6" -> "6"; a label alone -> its letter."""
    letter = _choice_letter(s)
    if letter is None:
        return s
    rest = _LABEL.sub(lambda m: m.group("open") or " ", s)
    return rest if re.search(r"[0-9A-Za-z\\]", _SPACING.sub("", rest)) else letter


def _ends_item(rest: str) -> bool:
    """Does an answer item end at the start of `rest` (after an optional ^2 / ^3)?"""
    rest = re.sub(r"^\s*\^\s*(?:\{\s*[23]\s*\}|[23])", "", rest).lstrip(" .~")
    return bool(re.match(r"$|[,;)\]&]|\\[}\\ ,;:!]|\\q?quad|\\(?:text|mbox)\s*\{\s*(?:or|and)\s*\}", rest))


def _replace_text_blocks(s: str) -> str:
    """\\text{...}-like blocks: the whole answer -> its content; "or"/"and" -> ","; unit or word -> removed
    (with a following ^2 / ^3); anything else -> its content."""
    for _ in range(50):
        m = _TEXT_CMD.search(s)
        if not m:
            return s
        end = match_brace(s, m.end() - 1)
        if end is None:
            return s[:m.start()] + s[m.end():]
        content = s[m.end():end]
        tail = end + 1
        if not s[:m.start()].strip() and not s[tail:].strip(" ."):
            return content.strip()
        if m.group().startswith("\\operatorname"):
            new = content
        elif re.search(r"(?<![a-zA-Z])(?:or|and)(?![a-zA-Z])", content):  # "\text{ or }", "\text{ (or }"
            new = re.sub(r"(?<![a-zA-Z])(?:or|and)(?![a-zA-Z])", ",", content)
        elif _UNIT_TEXT.fullmatch(content) and _ends_item(s[tail:]):  # only a unit word ending an item is
            new = ""  # dropped: "5 \text{ million}" and "5 \text{ times } 3" keep their words (WRONG for 5, 53)
            power = re.match(r"\s*\^\s*(?:\{\s*[23]\s*\}|[23])", s[tail:])
            if power:
                tail += power.end()
        else:
            new = content
        s = s[:m.start()] + new + s[tail:]
    return s


def _brace_args(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\sqrt2 -> \\sqrt{2}, \\frac{270}7 -> \\frac{270}{7}, \\binom52 -> \\binom{5}{2}
    (right to left, so nested ones too)."""
    for m in list(re.finditer(r"\\(frac|sqrt|binom)(?![a-zA-Z])", s))[::-1][:200]:
        i = m.end()
        if m.group(1) == "sqrt" and s[i:i + 1] == "[":
            close = s.find("]", i)
            if close < 0:
                continue
            i = close + 1
        for _ in range(1 if m.group(1) == "sqrt" else 2):
            while s[i:i + 1] == " ":
                i += 1
            if s[i:i + 1] == "{":
                end = match_brace(s, i)
                if end is None:
                    break
                i = end + 1
                continue
            arg = re.match(r"\d|[a-zA-Z]|\\(?!frac|sqrt|binom)[a-zA-Z]+", s[i:i + 40])
            if not arg:
                break
            s = s[:i] + "{" + arg.group() + "}" + s[i + arg.end():]
            i += arg.end() + 2
    return s


def _strip_outer(s: str, open_: str, close: str) -> str:
    while s.startswith(open_) and s.endswith(close) and _closes_at_end(s):
        s = s[len(open_):len(s) - len(close)]
    return s


def _closes_at_end(s: str) -> bool:
    """Does the bracket opening s close only at its last character?"""
    depth = 0
    toks = _tokens(s)
    for k, t in enumerate(toks):
        depth += _OPENERS.get(t, 0)
        if depth == 0 and k < len(toks) - 1:
            return False
    return depth == 0


_OPENERS = {"(": 1, "[": 1, "{": 1, "\\{": 1, ")": -1, "]": -1, "}": -1, "\\}": -1}


def _tokens(s: str) -> list[str]:
    return _TOKEN.findall(s)


# a mixed number: digits then \frac of digits, alone between item or chain separators (else 2\frac{\pi}{3} is a product)
_MIXED = re.compile(r"(?<![^,;(\[{=])(-?)(\d{1,50})\\frac\{(\d{1,50})\}\{(\d{1,50})\}(?![^,;)\]}=\\])")


def _mixed(m: re.Match) -> str:
    whole, num, den = int(m.group(2)), int(m.group(3)), int(m.group(4))
    return f"{m.group(1)}\\frac{{{whole * den + num}}}{{{den}}}" if den else m.group()


def _repeating(m: re.Match) -> str:
    """0.1\\overline{6} -> \\frac{1}{6} (whole part, non-repeating digits, repeating digits)."""
    whole, fixed, rep = int(m.group(1) or 0), m.group(2), m.group(3)
    v = whole + Fraction(int(fixed or 0), 10 ** len(fixed)) + Fraction(int(rep), (10 ** len(rep) - 1) * 10 ** len(fixed))
    return f"\\frac{{{v.numerator}}}{{{v.denominator}}}" if v.denominator != 1 else str(v.numerator)


def normalize(s: str) -> str:
    """Canonical LaTeX string of an answer (see the module docstring); only string rewrites, no evaluation."""
    s = str(s)[:MAX_RESPONSE_CHARS]
    s = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", s)
    listed = re.search(r"\d,\s", s) is not None  # "190, 129, 130" is a list; "190,129,130" may be thousands
    s = _UNICODE_ROOT.sub(lambda m: f"{_ROOT_COMMAND[m.group(1)]}{{{m.group(2)}}}", s)
    for k, v in _UNICODE.items():
        if k in s:
            s = s.replace(k, v)
    s = _SUPERSCRIPTS.sub(lambda m: "^{" + m.group().translate(_SUPERSCRIPT_DIGITS) + "}", s)  # 5² -> 5^{2}
    s = _SUBSCRIPTS.sub(lambda m: "_{" + m.group().translate(_SUBSCRIPT_DIGITS) + "}", s)
    s = _PHANTOM.sub("", s)  # invisible (alignment in matrices): "\phantom{-}1" is 1, "0\phantom{10}" is 0
    s = re.sub(r"\\(?:lor|vee)(?![a-zA-Z])", ",", s)  # "2 \lor 4": a list (like "or"), not 2
    if "\\begin" not in s:  # a line break outside a matrix or array: one more item, not a place to hide one
        s = re.sub(r"\\\\|\\newline(?![a-zA-Z])", ",", s)
    s = re.sub(r"\\\\|\\[$()\[\]]|\$", lambda m: m.group() if m.group() == "\\\\" else "", s)
    s = re.sub(r"\\(?:Rightarrow|Longrightarrow|implies)\s*(?:\\text(?:bf)?\{\s*\(?[A-E]\)?\s*\}|\(?[A-E]\)?)\s*$", "", s)
    s = _drop_choice_label(s)
    s = re.sub(r"\\(?:dfrac|tfrac|cfrac)(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\\(?:boxed|fbox)\s*(?=\{)", "", s)  # boxes inside the final box: "\boxed{5} or \boxed{6}" is a list
    s = re.sub(r"\\(?:dbinom|tbinom)(?![a-zA-Z])", r"\\binom", s)
    s = re.sub(r"\{([^{}]*)\\choose(?![a-zA-Z])([^{}]*)\}", r"\\binom{\1}{\2}", s)  # {5 \choose 2}
    s = re.sub(r"^([^{}]*)\\choose(?![a-zA-Z])([^{}]*)$", r"\\binom{\1}{\2}", s)  # 5 \choose 2
    s = _REALS.sub(r"(-\\infty,\\infty)", s)  # \mathbb{R}: the interval, as answers write it either way
    s = re.sub(r"\\hspace\*?\{[^{}]*\}|\\textdollar(?![a-zA-Z])", " ", s)
    s = re.sub(r"\\(?:left|right)\s*\.", "", s)
    s = _SIZING.sub("", s)
    # "a \quad b" is two items (not the product a b); other spacing is a space
    s = _SPACING.sub(lambda m: m.group() if m.group() == "\\\\" else "," if "quad" in m.group() else " ", s)
    s = s.replace("{,}", ",").replace("\\lbrace", "\\{").replace("\\rbrace", "\\}")
    s = re.sub(r"\\langle(?![a-zA-Z])", "(", s)
    s = re.sub(r"\\rangle(?![a-zA-Z])", ")", s)
    s = re.sub(r"\\(?:leq|leqslant)(?![a-zA-Z])", r"\\le", s)
    s = re.sub(r"\\(?:geq|geqslant)(?![a-zA-Z])", r"\\ge", s)
    s = re.sub(r"\\(?:neq)(?![a-zA-Z])", r"\\ne", s)
    s = re.sub(r"\\(?:approx|equiv)(?![a-zA-Z])", "=", s)  # a side of a chain: "5 \approx 6" must agree too
    if _TRIG.search(s):  # degrees inside trig are degrees: \sin 30^\circ = 1/2 (elsewhere the unit is dropped)
        s = _DEGREES.sub(r"(\\frac{\1\\pi}{180})", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])", "", s)
    s = re.sub(r"(?<!\\)%(?=\s*[^\s.])", ",", s)  # a bare % with more after it starts a LaTeX comment: not "w% g"
    s = s.replace("\\%", "").replace("%", "")
    s = _replace_text_blocks(s).strip()
    s = _TRAILING_UNIT.sub("", s)
    s = re.sub(r"(?:,|(?<=[\w})])\s)\s*(?:or|and)\s+(?=[\w\\{(-])", ",", s)  # "2, 3, or 4", "9 and -7"
    s = _FUNCTION.sub(r"\\\1", s)
    s = re.sub(r"\\log_\s*(?:e|\{\s*e\s*\})(?![a-zA-Z])", r"\\ln ", s)  # \log_e 2 = \ln 2
    # \log_2 3 -> \log_{2}(3): else "\log_2 3\cdot\log_3 4" is read as one logarithm of everything after it
    s = _LOG_BASE.sub(lambda m: f"\\log_{{{m.group(1).strip('{}')}}}({m.group(2).strip('{}')})", s)
    s = re.sub(r"^(?:final\s+)?answer\s*[:=]", "", s.strip(), flags=re.I)
    s = re.sub(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])", "\\1\x01", s)  # keep "\cot x" apart
    s = re.sub(r"\s+", "", s).replace("\x01", " ")
    s = s.rstrip(".").rstrip("\\").rstrip(",").lstrip(",")
    s = re.sub(r"\^\{\}|_\{\}", "", s).replace("{-}", "-").replace("{+}", "+").replace("\\mid", "|")
    s = re.sub(r",{2,}", ",", s.lstrip("="))
    s = re.sub(r"(\d*)\.(\d{0,30})\\overline\{?(\d{1,30})\}?", _repeating, s)  # 0.\overline{3} -> \frac{1}{3}
    s = re.sub(r"\\sqrt\(([^()]*)\)", r"\\sqrt{\1}", s)
    s = _brace_args(s)
    s = re.sub(r"([\^_])\{(\w)\}(?![\d.])", r"\1\2", s)  # x^{2} -> x^2, but 2^{2}3 stays (not 2^23)
    s = re.sub(r"(?<![a-zA-Z\\])pi(?![a-zA-Z])", r"\\pi", s)
    s = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", s)
    s = re.sub(r"\+\\infty", r"\\infty", s)
    s = re.sub(r"^\+(?=\d)", "", s)
    s = _strip_outer(s, "{", "}")
    m = _VAR_PREFIX.match(s) or _TUPLE_PREFIX.match(s)
    if m and m.end() < len(s) and "=" not in s[m.end():]:
        s = s[m.end():]
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s) and not listed:
        s = s.replace(",", "")
    s = _MIXED.sub(_mixed, s)  # 1\frac{4}{5} -> \frac{9}{5}, as the whole answer or an item of a list or chain
    m = re.fullmatch(r"\(([A-Z])\)|([A-Z])[.)]", s)
    if m:
        s = m.group(1) or m.group(2)
    return s


# ---------------------------------------------------------------- bounded evaluator

class _NotNumeric(Exception):
    """Not a closed numeric expression (variables, functions, unknown commands): undecided."""


class _TooBig(Exception):
    """Over a resource cap (power tower, huge factorial, deep nesting): refused."""


class _Undefined(Exception):
    """Division by zero and the like."""


def _check_size(v):
    if isinstance(v, Fraction):
        if v.numerator.bit_length() > MAX_BITS or v.denominator.bit_length() > MAX_BITS:
            raise _TooBig("value too large")
        return v
    if cmath.isnan(v) or cmath.isinf(v):
        raise _NotNumeric("float overflow")
    return v


def _approx(v) -> complex:
    if isinstance(v, Fraction):
        try:
            z = complex(float(v))
        except OverflowError:
            raise _NotNumeric("too large for floats") from None
        if z == 0 and v != 0:
            raise _NotNumeric("too small for floats")
        return z
    return v


def _arith(op: str, a, b):
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if op == "/" and b == 0:
            raise _Undefined("division by zero")
        return _check_size(a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b)
    a, b = _approx(a), _approx(b)
    if op == "/" and b == 0:
        raise _Undefined("division by zero")
    return _check_size(a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b)


def _int_root(n: int, k: int) -> int | None:
    if n < 0 or n.bit_length() > 4000:
        return None
    r = round(n ** (1.0 / k)) if n.bit_length() < 1000 else None
    if r is None:
        return None
    for c in (r - 1, r, r + 1):
        if c >= 0 and c ** k == n:
            return c
    return None


def _pow(a, b):
    if isinstance(b, Fraction) and b.denominator == 1:
        e = b.numerator
        if isinstance(a, Fraction):
            if a == 0:
                if e < 0:
                    raise _Undefined("0 to a negative power")
                return Fraction(1) if e == 0 else Fraction(0)
            if abs(a) == 1:
                return a ** (e % 2)
            if abs(e) * max(a.numerator.bit_length(), a.denominator.bit_length()) > MAX_BITS:
                raise _TooBig("power too large")
            return _check_size(a ** e)
        if abs(e) > 10_000:
            raise _TooBig("exponent too large")
        if a == 0 and e < 0:
            raise _Undefined("0 to a negative power")
        return _check_size(a ** e)
    if isinstance(b, Fraction) and isinstance(a, Fraction) and a >= 0 and b.denominator <= 64:
        num, den = _int_root(a.numerator, b.denominator), _int_root(a.denominator, b.denominator)
        if num is not None and den is not None:
            return _pow(Fraction(num, den), Fraction(b.numerator))
    za, zb = _approx(a), _approx(b)
    if abs(zb) > 10_000:
        raise _TooBig("exponent too large")
    if za == 0:
        if zb.real <= 0:
            raise _Undefined("0 to a non-positive power")
        return complex(0)
    try:
        return _check_size(za ** zb)
    except OverflowError:
        raise _NotNumeric("float overflow") from None


def _odd_integer(k) -> bool:
    return isinstance(k, Fraction) and k.denominator == 1 and k.numerator % 2 == 1


def _negative_real(v) -> bool:
    return v < 0 if isinstance(v, Fraction) else v.imag == 0 and v.real < 0


def _factorial(v):
    if not (isinstance(v, Fraction) and v.denominator == 1 and v >= 0):
        raise _NotNumeric("factorial of a non-integer")
    if v > MAX_FACTORIAL:
        raise _TooBig("factorial too large")
    return Fraction(math.factorial(int(v)))


def _gamma(v):
    """\\Gamma(n) = (n-1)! at positive integers (so \\Gamma(10^{10}) is refused like a huge factorial, in-process);
    elsewhere undecided (the symbolic step)."""
    if isinstance(v, Fraction) and v.denominator == 1:
        if v <= 0:
            raise _Undefined("pole of Gamma")
        return _factorial(v - 1)
    raise _NotNumeric("Gamma of a non-integer")


def _binom(n, k):
    """\\binom{n}{k} of integers n >= 0 exactly (refused when the result could pass MAX_BITS); else undecided."""
    if not all(isinstance(x, Fraction) and x.denominator == 1 for x in (n, k)) or n < 0:
        raise _NotNumeric("binomial of non-integers")
    n, k = int(n), int(k)
    if k < 0 or k > n:
        return Fraction(0)
    k = min(k, n - k)
    if k * n.bit_length() > MAX_BITS:
        raise _TooBig("binomial too large")
    return Fraction(math.comb(n, k))


def _number(tok: str) -> Fraction:
    tok = tok.rstrip(".")
    if len(tok) > 400:
        raise _TooBig("literal too long")
    m = re.fullmatch(r"(\d*\.?\d*)[eE]([-+]?\d+)", tok)
    if m and abs(int(m.group(2))) > 400:
        raise _TooBig("exponent too large")
    return Fraction(tok)


_MUL = {"*", "\\cdot", "\\times"}
_DIV = {"/", "\\div"}
_CONST = {"\\pi": complex(math.pi), "i": 1j}


_BINOM = {"\\binom", "\\dbinom", "\\tbinom"}
_ATOM_START = {"(", "{", "\\frac", "\\sqrt", "\\pi", "\\Gamma"} | _BINOM
_GREEK = {"\\" + g for g in ("alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta kappa lambda mu "
                              "nu xi rho sigma tau phi varphi chi psi omega").split()}


class _Evaluator:
    """Recursive descent over LaTeX tokens: + - * / \\cdot \\times \\div ^ ! \\frac \\sqrt[n] \\pi i \\Gamma
    \\binom, implicit multiplication, () {} grouping. Raises _NotNumeric / _TooBig / _Undefined."""

    def __init__(self, s: str, env: dict | None = None):
        self.env = env or {}  # values of variables (the random-point check)
        self.toks = [t for t in _tokens(s) if not t.isspace()]
        self.i = 0
        self.depth = 0

    def value(self):
        v = self.expr()
        if self.i != len(self.toks):
            raise _NotNumeric(f"unexpected {self.toks[self.i]!r}")
        return v

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self):
        t = self.peek()
        if t is None:
            raise _NotNumeric("unexpected end")
        self.i += 1
        return t

    def enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _TooBig("nested too deeply")

    def expr(self):
        self.enter()
        v = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            v = _arith(op, v, self.term())
        self.depth -= 1
        return v

    def term(self):
        v = self.unary()
        while True:
            t = self.peek()
            if t in _MUL:
                self.take()
                v = _arith("*", v, self.unary())
            elif t in _DIV:
                self.take()
                v = _arith("/", v, self.unary())
            elif t is not None and (t[0].isdigit() or t[0] == "." or t.isalpha() or t in _ATOM_START or t in self.env):
                if (t[0].isdigit() or t[0] == ".") and self.toks[self.i - 1][-1:].isdigit():
                    raise _NotNumeric("two numbers in a row")  # "10.00.000", "1.2.3": not a product
                v = _arith("*", v, self.power())  # implicit multiplication: 2\pi, 3\sqrt{2}, 2(3)
            else:
                return v

    def unary(self):
        t = self.peek()
        if t in ("-", "+"):
            self.take()
            self.enter()
            v = self.unary()
            self.depth -= 1
            return _arith("-", Fraction(0), v) if t == "-" else v
        return self.power()

    def power(self):
        base = self.postfix()
        if self.peek() == "^":
            self.take()
            self.enter()
            sign = self.take() if self.peek() in ("-", "+") else "+"
            e = self.power()
            if sign == "-":
                e = _arith("-", Fraction(0), e)
            self.depth -= 1
            return _pow(base, e)
        return base

    def postfix(self):
        v = self.atom()
        while self.peek() == "!":
            self.take()
            v = _factorial(v)
        return v

    def group(self):
        if self.peek() == "{":
            self.take()
            v = self.expr()
            if self.take() != "}":
                raise _NotNumeric("unbalanced braces")
            return v
        return self.postfix()

    def atom(self):
        self.enter()
        t = self.take()
        if t[0].isdigit() or t[0] == ".":
            v = _number(t)
        elif t in ("(", "{"):
            v = self.expr()
            if self.take() != {"(": ")", "{": "}"}[t]:
                raise _NotNumeric("unbalanced brackets")
        elif t == "\\frac":
            num = self.group()
            v = _arith("/", num, self.group())
        elif t == "\\sqrt":
            k = Fraction(2)
            if self.peek() == "[":
                self.take()
                k = self.expr()
                if self.take() != "]":
                    raise _NotNumeric("unbalanced \\sqrt[")
            base = self.group()
            if _odd_integer(k) and _negative_real(base):  # \sqrt[3]{-8} = -2: the real root, as answers mean it
                v = _arith("-", Fraction(0), _pow(_arith("-", Fraction(0), base), _arith("/", Fraction(1), k)))
            else:
                v = _pow(base, _arith("/", Fraction(1), k))
        elif t == "\\Gamma":
            v = _gamma(self.group())
        elif t in _BINOM:
            n = self.group()
            v = _binom(n, self.group())
        elif t in _CONST:
            v = _CONST[t]
        elif t in self.env:
            v = self.env[t]
        else:
            raise _NotNumeric(f"not numeric: {t!r}")
        self.depth -= 1
        return v


@functools.lru_cache(maxsize=1024)  # a set answer compares each item with each of the gold's
def _value(s: str):
    """("ok", value) | ("notnum", None) | ("toobig", None) | ("undefined", None)."""
    try:
        return "ok", _Evaluator(s).value()
    except _NotNumeric:
        return "notnum", None
    except _TooBig:
        return "toobig", None
    except (_Undefined, ZeroDivisionError):
        return "undefined", None
    except (OverflowError, ValueError, ArithmeticError):
        return "notnum", None


def _differ_at_points(p: str, g: str) -> bool:
    """True if p and g, as functions of their single-letter / Greek variables, take different exact values at
    one of two fixed rational points (then they are certainly not equal). False: no conclusion (equal there,
    or not rational at the points: roots, pi, functions, ...)."""
    names = sorted({t for t in _tokens(p) + _tokens(g) if len(t) == 1 and t.isalpha() and t not in "ie" or t in _GREEK})
    if not names or len(names) > 8:
        return False
    for a, b in zip(_at_points(p, tuple(names)), _at_points(g, tuple(names))):
        if a is None or b is None:
            return False
        if a != b:
            return True
    return False


@functools.lru_cache(maxsize=1024)
def _at_points(s: str, names: tuple) -> tuple:
    """The exact values of s at the two points of _differ_at_points (None where it is not rational there)."""
    out = []
    for j in range(2):
        env = {n: Fraction(11 + 7 * k + 3 * j, 5 + 2 * k + j) for k, n in enumerate(names)}
        try:
            v = _Evaluator(s, env).value()
        except (_NotNumeric, _TooBig, _Undefined, ArithmeticError, ValueError):
            v = None
        out.append(v if isinstance(v, Fraction) else None)
    return tuple(out)


def _num_equal(a, b, approximate: bool = False) -> bool | None:
    """Exact values: Fractions compare exactly; floats (roots, pi, i) that clearly differ are False, else None
    (undecided: the symbolic step decides). approximate (the gold is a decimal): relative NUMERIC_REL_TOL, for
    rationals too (1.4142136 for the gold 1.414214), computed exactly."""
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if approximate:
            return abs(a - b) <= _REL_TOL * max(abs(a), abs(b))
        return a == b
    try:
        a, b = _approx(a), _approx(b)
    except _NotNumeric:
        return None
    if approximate:  # real and imaginary parts each to their own tolerance: 5e10 + i is not 5e10
        return all(abs(x - y) <= NUMERIC_REL_TOL * max(abs(x), abs(y)) + 1e-15
                   for x, y in ((a.real, b.real), (a.imag, b.imag)))
    if abs(a - b) > DISTINCT_REL_TOL * max(abs(a), abs(b)) + 1e-300:
        return False
    return None


_REL_TOL = Fraction(str(NUMERIC_REL_TOL))
_DECIMAL = re.compile(r"(?<![\\a-zA-Z])\d*\.\d")


def _is_approximate(g: str) -> bool:
    """Is the gold answer a decimal approximation (it has a decimal point)?"""
    return bool(_DECIMAL.search(g))


# ---------------------------------------------------------------- structure and comparison

def _split_top(s: str, sep: str) -> list[str]:
    """s split at the separator token `sep` outside brackets."""
    parts, cur, depth = [], [], 0
    for t in _tokens(s):
        depth += _OPENERS.get(t, 0)
        if t == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(t)
    parts.append("".join(cur))
    return parts


def _depth(s: str) -> int:
    depth = best = 0
    for t in _tokens(s):
        depth += _OPENERS.get(t, 0)
        best = max(best, depth)
    return best


def _strip_var(s: str) -> str:
    m = _VAR_PREFIX.match(s)
    return s[m.end():] if m and m.end() < len(s) and "=" not in s[m.end():] else s


def _expand_pm(elems: list[str]) -> list[str]:
    """1\\pm\\sqrt{2} -> 1+\\sqrt{2}, 1-\\sqrt{2} (one \\pm or \\mp per element)."""
    out = []
    for e in elems:
        toks = _tokens(e)
        pm = [k for k, t in enumerate(toks) if t in ("\\pm", "\\mp")]
        if len(pm) == 1:
            k = pm[0]
            first, second = ("+", "-") if toks[k] == "\\pm" else ("-", "+")
            out += ["".join(toks[:k] + [first] + toks[k + 1:]), "".join(toks[:k] + [second] + toks[k + 1:])]
        else:
            out.append(e)
    return out


_MATRIX = re.compile(r"\\begin\{([pbBvV]?matrix|smallmatrix|array)\}(.*)\\end\{\1\}", re.S)


@functools.lru_cache(maxsize=1024)  # each item of a set answer meets each of the gold's; the lists are read only
def _structure(s: str):
    """("scalar", s) | ("seq", brackets, [items]) | ("set", [items]) | ("union", [items]) | ("matrix", rows)."""
    parts = _split_top(s, "\\cup")
    if len(parts) > 1:
        return ("union", parts)
    m = _MATRIX.fullmatch(s)
    if m:
        body = re.sub(r"^\{[lcr|]*\}", "", m.group(2)) if m.group(1) == "array" else m.group(2)
        rows = [r for r in _split_top(body, "\\\\") if r]
        return ("matrix", [_split_top(r, "&") for r in rows])
    if s.startswith("\\{") and s.endswith("\\}") and _closes_at_end(s):
        return ("set", _expand_pm([_strip_var(e) for e in _split_top(s[2:-2], ",")]))
    if s[:1] in "([" and s[-1:] in ")]" and _closes_at_end(s):
        items = _split_top(s[1:-1], ",")
        if len(items) >= 2:
            return ("seq", s[0] + s[-1], [_strip_var(e) for e in items])
    items = _split_top(s, ",")
    if len(items) == 1:
        items = _split_top(s, ";")
    items = _expand_pm([_strip_var(e) for e in items])
    if len(items) >= 2:
        return ("set", items)
    return ("scalar", items[0])


_RELATION = re.compile(r"[<>]|\\(?:le|ge|lt|gt|ne|in)(?![a-zA-Z])")
_NUMBER_SUBSCRIPT = re.compile(r"(?:(?<![\\a-zA-Z0-9])\d[0-9A-Za-z]*|\(\d+\)|\{\d+\})\s*_")  # numeral, subscript


# The LaTeX commands an answer may hold beyond those normalize() rewrites: those that may reach sympy (its parser
# drops or guesses what it does not know: it read "2 \lor 4", "0\phantom{10}", "81/10\tag{81}" and a "6" with a
# combining stroke as the gold) and those of a text answer. Any other (\not, \neg, \cancel, \sout, \tag,
# \footnote, \color ...) makes an answer WRONG unless the gold has it too.
_KNOWN_COMMANDS = frozenset("\\" + c for c in """
    frac sqrt cdot times div pm mp le ge lt gt ne leq geq neq sim infty cup cap setminus in notin subset
    subseteq supset supseteq emptyset varnothing mid vert lvert rvert lfloor rfloor lceil rceil langle rangle begin
    end circ sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln exp lg max min gcd lcm det deg
    pi alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho varrho sigma
    varsigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Pi Sigma Upsilon Phi Psi Omega
    binom dbinom tbinom choose mod bmod pmod prime dot ddot bar overline hat vec tilde widehat angle triangle hbar ell
    partial nabla sum prod int lim to rightarrow mho odot""".split())


def _unknown_commands(p: str, g: str) -> bool:
    """Does p hold a command neither known nor in g?"""
    return bool(set(re.findall(r"\\[a-zA-Z]+", p)) - _KNOWN_COMMANDS - set(re.findall(r"\\[a-zA-Z]+", g)))


def _is_text(s: str) -> bool:
    bare = re.sub(r"\\[a-zA-Z]+", " ", s)
    return bool(re.search(r"[a-zA-Z]{3,}", bare))


def _text_key(s: str) -> str:
    """Letters and digits, lower case; non-ASCII characters are kept (a combining stroke makes "even" "not even")."""
    return "".join(ch for ch in re.sub(r"\\[a-zA-Z]+", "", s).lower() if ch.isalnum() or not ch.isascii())


def _scalar(p: str, g: str):
    """True / False / [("eq", p, g)] (symbolic check needed)."""
    if p == g:
        return True
    if not p or "\\infty" in p or "\\infty" in g:
        return False
    if re.fullmatch(r"[A-Z]", g) or re.fullmatch(r"[A-Z]", p):  # choice letters
        return p == g
    if "=" in p:
        chain = _chain(p, g)
        if chain is not None:
            return chain
    if _NUMBER_SUBSCRIPT.search(p) or _NUMBER_SUBSCRIPT.search(g):  # 52_8, 86_{87+0}: a numeral in a base is
        return False  # compared as written (p != g here), never as the number without its subscript
    if _is_text(g) or _is_text(p):
        return _text_key(p) == _text_key(g) and bool(_text_key(g)) and not _unknown_commands(p, g)
    ps, pv = _value(p)
    gs, gv = _value(g)
    if ps in ("toobig", "undefined") or gs in ("toobig", "undefined"):
        return False
    if gs == "ok" and _RELATION.search(p) or ps == "ok" and _RELATION.search(g):  # "x > 5" is not the number 5
        return False
    if ps == gs == "ok":
        eq = _num_equal(pv, gv, _is_approximate(g))
        if eq is not None:
            return eq
        return [("numeq", p, g)]  # closed forms equal to double precision: sympy decides exactly
    if ("\\pm" in p or "\\mp" in p) != ("\\pm" in g or "\\mp" in g):
        return False  # Math-Verify #14: \pm 2021 must not match 2021
    if ps != "toobig" and gs != "toobig" and _differ_at_points(p, g):
        return False  # x^2+7x+11 vs x^2+7x+10: no sympy needed
    return [("eq", p, g)]


def _perfect(ok: list[list[bool]]) -> bool:
    """Does the bipartite graph ok[i][j] have a perfect matching? (Kuhn's augmenting paths)"""
    owner = [-1] * len(ok)

    def augment(i, seen):
        for j, edge in enumerate(ok[i]):
            if edge and j not in seen:
                seen.add(j)
                if owner[j] < 0 or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return all(augment(i, set()) for i in range(len(ok)))


def _match(ps: list, gs: list, depth: int) -> bool | list:
    """Unordered: True if a perfect matching of equal items exists, False if none can, else
    [("match", table)] for the symbolic step (table cells: True, False or requirements)."""
    if len(ps) != len(gs) or len(ps) > MAX_SET_SIZE:
        return False
    table = [[_compare(a, b, depth + 1) for b in gs] for a in ps]
    if _perfect([[c is True for c in row] for row in table]):
        return True
    if not _perfect([[c is not False for c in row] for row in table]):
        return False
    return [("match", table)]


def _all(results: list) -> bool | list:
    pending = []
    for r in results:
        if r is False:
            return False
        if r is not True:
            pending += r
    return pending or True


def _compare(p: str, g: str, depth: int = 0) -> bool | list:
    """Equality of two normalised answers: True, False, or a list of requirements for the symbolic step, all
    of which must hold: ("eq", pred, gold) or ("match", table) (see _match)."""
    if p == g:
        return True
    if depth > 4:
        return False
    sp, sg = _structure(p), _structure(g)
    kind = sp[0]
    if kind == "scalar" and sg[0] != "scalar" and "=" in p:  # "(x,y)=(2,13)=(2,13)": every side must be the gold
        chain = _chain(p, g)
        if chain is not None:
            return chain
    if {kind, sg[0]} == {"matrix", "seq"}:  # a vector written as a tuple
        mat, seq = (sp, sg) if kind == "matrix" else (sg, sp)
        flat = [x for row in mat[1] for x in row]
        if seq[1] == "()" and (len(mat[1]) == 1 or all(len(r) == 1 for r in mat[1])) and len(flat) == len(seq[2]):
            return _all([_compare(a, b, depth + 1) for a, b in zip(flat, seq[2])])
        return False
    if kind != sg[0]:
        if {kind, sg[0]} == {"scalar", "seq"} or {kind, sg[0]} == {"scalar", "union"}:
            scalar = sp[1] if kind == "scalar" else sg[1]
            if _RELATION.search(scalar):  # x > 5 vs (5, \infty): sympy decides
                return [("eq", p, g)]
        return False
    if kind == "scalar":
        return _scalar(sp[1], sg[1])
    if kind == "seq":
        if sp[1] != sg[1] or len(sp[2]) != len(sg[2]):
            return False
        return _all([_compare(a, b, depth + 1) for a, b in zip(sp[2], sg[2])])
    if kind == "matrix":
        if [len(r) for r in sp[1]] != [len(r) for r in sg[1]]:
            return False
        return _all([_compare(a, b, depth + 1) for ra, rb in zip(sp[1], sg[1]) for a, b in zip(ra, rb)])
    return _match(sp[1], sg[1], depth)  # set / union


def _screen(s: str) -> bool:
    """May this string go to sympy? ASCII only, known commands only, no empty item ("(,", ",,": what sympy's
    parser skips over), no huge exponents, factorials or literals, no deep nesting."""
    if len(s) > SYMBOLIC_MAX_CHARS or _depth(s) > SYMBOLIC_MAX_DEPTH:
        return False
    if not s.isascii() or re.search(r"[(\[{,;][,;)\]}]|\d\.\d*\.\d", s):  # "1.2.3": no number to guess
        return False
    if _unknown_commands(s, ""):
        return False
    if sum(_OPENERS.get(t, 0) for t in _tokens(s)) != 0 or re.search(r"[-+*/^_=]$|[\^_]\{\}|\\$", s):
        return False  # malformed: math-verify would guess (2^ -> 2)
    if s.count("^") > 30 or s.count("!") > 5 or s.count("\\sqrt") > 12 or s.count("\\frac") > 20:
        return False
    if any(len(d) > SYMBOLIC_MAX_DIGITS for d in re.findall(r"\d+", s)):
        return False
    for m in re.finditer(r"\^", s):  # every exponent that has a value must be small
        rest = s[m.end():].lstrip()
        if rest.startswith("{"):
            end = match_brace(rest, 0)
            exp = rest[1:end] if end is not None else rest[1:]
        else:
            tok = _TOKEN.match(rest)
            exp = tok.group() if tok else ""
        status, v = _value(exp.lstrip("-+"))
        if status == "toobig" or status == "ok" and abs(v) > SYMBOLIC_MAX_EXPONENT:
            return False
        if status == "notnum" and exp.count("^") >= 2:  # x^{9^{9^9}}-like towers
            return False
    for m in re.finditer(r"(\d+|\}|\))\s*!", s):
        if m.group(1).isdigit() and int(m.group(1)) > 200:
            return False
    return True


def _strings(reqs: list):
    for req in reqs:
        if req[0] in ("eq", "numeq"):
            yield from req[1:]
        else:
            for row in req[1]:
                for cell in row:
                    if isinstance(cell, list):
                        yield from _strings(cell)


def _warm_up() -> None:
    """Runs once in each sandbox worker: imports and compiles math-verify's parsers."""
    _symbolic_equal([("eq", "\\frac{x}{2}", "x/2")])


def _sympy_differ(a, b) -> bool:
    """Do two sympy expressions take clearly different values at one of two rational points? (cheap WRONG)"""
    from sympy import Expr, Rational

    if not (isinstance(a, Expr) and isinstance(b, Expr)):
        return False
    names = sorted(a.free_symbols | b.free_symbols, key=str)
    if len(names) > 8:
        return False
    for j in range(2):
        point = {n: Rational(11 + 7 * k + 3 * j, 5 + 2 * k + j) for k, n in enumerate(names)}
        try:
            za, zb = complex(a.subs(point).evalf(30)), complex(b.subs(point).evalf(30))
        except (TypeError, ValueError, ArithmeticError):
            return False
        if not (cmath.isfinite(za) and cmath.isfinite(zb)):
            return False
        if abs(za - zb) > 1e-6 * max(abs(za), abs(zb)) + 1e-12:
            return True
    return False


def _exact_closed(gold, pred) -> bool:
    """Are both closed numbers (no variables) and the gold exact (no decimal)? Then compare exactly."""
    from sympy import Expr, Float

    return (isinstance(gold, Expr) and isinstance(pred, Expr) and not gold.free_symbols and not pred.free_symbols
            and not gold.atoms(Float))


def _sympy_exact_equal(a, b) -> bool:
    """In the sandbox worker: are two closed sympy numbers exactly equal (decimals read as exact rationals)?"""
    from sympy import Dummy, Expr, Float, Rational, minimal_polynomial, simplify

    if not (isinstance(a, Expr) and isinstance(b, Expr)):
        return False
    a, b = (x.xreplace({f: Rational(str(f)) for f in x.atoms(Float)}) for x in (a, b))
    d = a - b
    if d == 0:
        return True
    try:  # an algebraic difference (roots, cos(pi/5)) is 0 exactly when its minimal polynomial is z: fast and exact
        z = Dummy("z")
        return minimal_polynomial(d, z) == z
    except (MemoryError, RecursionError):
        raise
    except Exception:  # not algebraic (pi, e, logs): sympy's general tests
        pass
    return simplify(d) == 0 or d.equals(0) is True


def _as_evaluated(x):
    """In the sandbox worker: a parsed value read as the in-process evaluator reads it: the letter i is the
    imaginary unit (e^{i\\pi} = -1), an odd root of a negative number is real (\\sqrt[3]{-2} = -\\sqrt[3]{2})."""
    from sympy import Expr, I, Pow

    if not hasattr(x, "subs"):
        return x
    x = x.subs({s: I for s in getattr(x, "free_symbols", ()) if s.name == "i"})
    if isinstance(x, Expr):
        x = x.replace(lambda e: isinstance(e, Pow) and e.exp.is_Rational and e.exp.p == 1 and e.exp.q % 2 == 1
                      and e.base.is_negative is True, lambda e: -Pow(-e.base, e.exp))
    return x


def _sums_equal(a, b) -> bool:
    """In the sandbox worker: is a sum or product with explicit bounds identical to the other side once evaluated?
    (\\sum_{k=0}^{30}\\binom{30}{k}x^k = (1+x)^{30}: an exact polynomial identity.)"""
    from sympy import Expr, Product, Sum, expand

    if not (isinstance(a, Expr) and isinstance(b, Expr) and (a.has(Sum, Product) or b.has(Sum, Product))):
        return False
    return expand(a.doit() - b.doit()) == 0


def _symbolic_equal(reqs: list) -> bool:
    """In the sandbox worker: do all requirements hold? ("eq", pred, gold): equal according to math-verify
    (sympy), after a cheap evaluation at two points; ("match", table): a perfect matching of equal cells."""
    import logging

    from math_verify import LatexExtractionConfig, parse
    from math_verify import verify as mv_verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
    from sympy.core.cache import clear_cache

    clear_cache()  # what earlier calls left in sympy's cache must not change this call's CPU time (its limit)
    parsed: dict[str, list] = {}

    def equal(p: str, g: str, closed: bool = False) -> bool:
        try:
            for t in (p, g):
                if t not in parsed:
                    # LaTeX only: the default also extracts a plain expression when the LaTeX does not parse,
                    # and found the 5 of "5 \\sum 6" (a string in parsed[t] is such a failure)
                    found = parse(f"${t}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
                    parsed[t] = [_as_evaluated(x) for x in found]
            gold, pred = parsed[g], parsed[p]
            if not gold or not pred or isinstance(gold[0], str) or isinstance(pred[0], str) \
                    or _sympy_differ(gold[0], pred[0]):
                return False
            if closed or _exact_closed(gold[0], pred[0]):  # no rounding: 3.1415926535897 != pi, 2.718281828 != e
                return _sympy_exact_equal(pred[0], gold[0])
            if _sums_equal(gold[0], pred[0]):  # math-verify leaves sums unevaluated (and spent seconds on them)
                return True
            return bool(mv_verify(gold, pred, allow_set_relation_comp=True, timeout_seconds=None))
        except (MemoryError, RecursionError):
            raise
        except Exception:
            return False

    def holds(req) -> bool:
        if req[0] in ("eq", "numeq"):
            return equal(req[1], req[2], req[0] == "numeq")
        return _perfect([[c is True or c is not False and all(holds(r) for r in c) for c in row] for row in req[1]])

    return all(holds(r) for r in reqs)


_pool: sandbox.Pool | None = None
_pool_lock = threading.Lock()


def _get_pool() -> sandbox.Pool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = sandbox.Pool(size=SANDBOX_WORKERS, init=_warm_up, memory_mb=SANDBOX_MEMORY_MB)
        return _pool


def warm_up(workers: int | None = None) -> None:
    """Start the sandbox workers now (optional: otherwise the first symbolic check starts one)."""
    _get_pool().warm(workers)


_CHOICE_ANY = re.compile(r"\(\s*(?:\\(?:textbf|text|mathrm|mathbf)\s*\{\s*)?([A-E])\s*\}?\s*\)"
                         r"|\\(?:textbf|text|mathrm|mathbf|mbox|textrm)\s*\{\s*\(?\s*([A-E])\s*\)?\s*\}")


def _choice_letters(pred: str) -> set[str]:
    """The distinct choice labels ("(B)", "\\textbf{(B)}", "(\\text{B})") anywhere in an answer."""
    return {m.group(1) or m.group(2) for m in _CHOICE_ANY.finditer(pred)}


def _chain(p: str, g: str) -> bool | list | None:
    """A relation chain against a gold without "=": "3=5", "x=3=5", "x=2+3=5". Every side after a leading
    non-numeric one (the variable or expression named) must equal the gold, so a chain whose parts disagree is
    WRONG. None: not a chain (a single "x+y=5" is left to the usual checks)."""
    if "=" in g:
        return None
    parts = _split_top(p, "=")
    if len(parts) < 2:
        return None
    rest = parts[1:] if _value(parts[0])[0] == "notnum" else parts
    if len(rest) < 2 and len(parts) == 2 and rest is not parts:
        return None
    if not all(rest) or len(rest) > MAX_SET_SIZE:
        return False
    return _all([_compare(x, g) for x in rest])


def _decide(pred: str, gold: str) -> Verdict | list:
    """Everything but the sandbox: a Verdict, or the requirements for the symbolic check (see _compare)."""
    p, g = normalize(pred), normalize(gold)
    if not p:
        return Verdict.UNPARSABLE
    if len(_choice_letters(pred)) > 1:  # "(A) (B) (C) (D) (E)", a copied options line: a hedge, not an answer
        return Verdict.WRONG
    if p == g:
        return Verdict.CORRECT
    if re.fullmatch(r"[A-E]", g) and _choice_letter(pred):
        return Verdict.CORRECT if _choice_letter(pred) == g else Verdict.WRONG
    if _depth(p) > MAX_DEPTH or _depth(g) > MAX_DEPTH or len(g) > MAX_ANSWER_CHARS:
        return Verdict.WRONG
    result = _compare(p, g)
    if result is True:
        return Verdict.CORRECT
    if result is False:
        return Verdict.WRONG
    if not all(_screen(x) for x in _strings(result)):
        return Verdict.WRONG
    return result


def _run_symbolic(reqs: list, timeout: float | None) -> Verdict:
    """The symbolic check in a worker: `timeout` (default SYMBOLIC_TIMEOUT) seconds of its CPU time."""
    cpu = SYMBOLIC_TIMEOUT if timeout is None else timeout
    try:
        equal = _get_pool().run(_symbolic_equal, reqs, cpu_time=cpu, timeout=max(SYMBOLIC_WALL_LIMIT, 10 * cpu))
    except sandbox.SandboxTimeout:
        return Verdict.TIMEOUT
    except (sandbox.SandboxError, MemoryError, RecursionError):  # resource limits: reported with timeouts
        return Verdict.TIMEOUT
    return Verdict.CORRECT if equal else Verdict.WRONG


def _gold_text(gold) -> str:
    return ", ".join(map(str, gold)) if isinstance(gold, (list, tuple)) else str(gold)


def check(pred: str, gold: str, timeout: float | None = None) -> Verdict:
    """Verdict for an already extracted answer `pred` against the reference `gold`. Never raises."""
    try:
        decided = _decide(pred, _gold_text(gold))
        return decided if isinstance(decided, Verdict) else _run_symbolic(decided, timeout)
    except Exception as e:  # a verifier bug costs one reward, not the run
        log.warning("math verifier raised %s: %s", type(e).__name__, e)
        return Verdict.UNPARSABLE


def verify(response: str, answer: str, timeout: float | None = None) -> Verdict:
    """Verdict of a whole response against the reference answer; `timeout`: seconds of CPU time for its symbolic
    check (default SYMBOLIC_TIMEOUT). Never raises.

    >>> verify("... so the answer is $\\\\boxed{\\\\dfrac{1}{2}}$.", "0.5")
    <Verdict.CORRECT: 'correct'>
    """
    try:
        return _verify(response, answer, timeout)
    except Exception as e:
        log.warning("math verifier raised %s: %s", type(e).__name__, e)
        return Verdict.UNPARSABLE


def _verify(response: str, answer, timeout: float | None = None) -> Verdict:
    """verify() without its guard (the fuzz test counts what this raises)."""
    pred = extract_answer(response)
    if pred is None:
        return Verdict.UNPARSABLE
    decided = _decide(pred, _gold_text(answer))
    return decided if isinstance(decided, Verdict) else _run_symbolic(decided, timeout)


def verify_batch(responses: list[str], answers: list[str], timeout: float | None = None) -> list[Verdict]:
    """verify() over many responses, with the same verdicts: the in-process checks run here, the symbolic ones in
    parallel over the sandbox workers, each under its own CPU-time limit (`timeout`, default SYMBOLIC_TIMEOUT);
    no deadline is shared, so a slow response cannot turn its neighbours into TIMEOUT (see "Time" above)."""
    verdicts: list = [None] * len(responses)
    pending = {}
    for k, (response, answer) in enumerate(zip(responses, answers)):
        try:
            pred = extract_answer(response)
            decided = Verdict.UNPARSABLE if pred is None else _decide(pred, _gold_text(answer))
        except Exception as e:
            log.warning("math verifier raised %s: %s", type(e).__name__, e)
            decided = Verdict.UNPARSABLE
        if isinstance(decided, Verdict):
            verdicts[k] = decided
        else:
            pending[k] = decided
    if pending:
        # one thread per worker: a thread waits only for its own worker (or that worker's replacement)
        with ThreadPoolExecutor(max_workers=min(len(pending), _get_pool().size)) as ex:
            for k, v in zip(pending, ex.map(lambda reqs: _run_symbolic(reqs, timeout), pending.values())):
                verdicts[k] = v
    return verdicts
