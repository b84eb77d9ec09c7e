"""Countdown verifier: is the last <answer>...</answer> an expression over the given numbers (each exactly
once, + - * / and parentheses) whose exact value is the target?

The response is hostile input: nothing is ever evaluated by Python. The text passes a character whitelist,
a length cap and a nesting-depth check before `ast.parse`, and the tree is walked with an allow-list
(BinOp of Add/Sub/Mult/Div over non-negative integer literals) using exact Fraction arithmetic, every
literal and intermediate value bounded in magnitude.

Unary minus/plus are rejected: the rules combine the given numbers with binary operators, a leaf like
`-5` would be a number that was not given, and any positive target reachable with negation is reachable
without it (a-(-b) = a+b, -(a-b) = b-a, ...).
"""
from __future__ import annotations

import ast
import logging
from fractions import Fraction

from bapo_vl.problem import Verdict

VERIFIER_VERSION = "countdown-1.0"  # bump when a response could be judged differently

log = logging.getLogger(__name__)

TIME_BUDGET = 0.02  # seconds (CPU) one verify() may take on any response: the caps below bound the work, and
# tests/test_verifier_fuzz.py holds it to this on >= 20,000 hostile responses
MAX_RESPONSE = 20_000  # longer responses: only the tail is searched for the answer
MAX_MAGNITUDE = 10**12  # bound on |literal|, and on numerator and denominator of every intermediate value
MAX_PAREN_DEPTH = 32
MAX_TREE_DEPTH = 128
ALLOWED_CHARS = frozenset("0123456789+-*/() \t\r\n")  # ASCII only: no unicode digits, no '.', 'e', '_'
OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
OPEN, CLOSE = "<answer>", "</answer>"


class CountdownParseError(ValueError):
    """The text is not a safe, well-formed countdown expression (or, from evaluate, has no valid value)."""


def extract_answer(response: str) -> str | None:
    """Text of the last <answer>...</answer> pair, or None."""
    response = response[-MAX_RESPONSE:]
    end = response.rfind(CLOSE)
    if end < 0:
        return None
    start = response.rfind(OPEN, 0, end)
    if start < 0:
        return None
    return response[start + len(OPEN):end]


def _parse(expr: str, max_len: int = 200) -> ast.expr:
    """Validated expression tree; raises CountdownParseError."""
    expr = expr.strip()
    if not expr or len(expr) > max_len:
        raise CountdownParseError("empty or too long")
    if not set(expr) <= ALLOWED_CHARS:
        raise CountdownParseError("disallowed character")
    depth = 0
    for ch in expr:  # checked before ast.parse, which can hit RecursionError/MemoryError on deep nesting
        depth += (ch == "(") - (ch == ")")
        if depth < 0 or depth > MAX_PAREN_DEPTH:
            raise CountdownParseError("unbalanced or too deeply nested parentheses")
    if depth:
        raise CountdownParseError("unbalanced parentheses")
    try:
        tree = ast.parse(expr, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CountdownParseError(f"syntax: {type(e).__name__}") from None
    _check(tree, 0)
    return tree


def _check(node: ast.AST, depth: int) -> None:
    if depth > MAX_TREE_DEPTH:
        raise CountdownParseError("expression too deep")
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        _check(node.left, depth + 1)
        _check(node.right, depth + 1)
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        if node.value > MAX_MAGNITUDE:
            raise CountdownParseError("number too large")
    else:
        raise CountdownParseError(f"{type(node).__name__} not allowed")


def _leaves(node: ast.expr) -> list[int]:
    if isinstance(node, ast.BinOp):
        return _leaves(node.left) + _leaves(node.right)
    return [node.value]


def _value(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    a, b = _value(node.left), _value(node.right)
    op = type(node.op)
    if op is ast.Div and b == 0:
        raise CountdownParseError("division by zero")
    v = a + b if op is ast.Add else a - b if op is ast.Sub else a * b if op is ast.Mult else a / b
    if abs(v.numerator) > MAX_MAGNITUDE or v.denominator > MAX_MAGNITUDE:
        raise CountdownParseError("intermediate value too large")
    return v


def evaluate(expr: str, max_len: int = 200) -> Fraction:
    """Exact value of a countdown expression; raises CountdownParseError if unsafe, malformed or invalid."""
    return _value(_parse(expr, max_len))


def verify(response: str, answer) -> Verdict:
    """`answer` = {"nums": [...], "target": int}. Never raises."""
    try:
        return _verify(response, answer)
    except Exception as e:  # last resort: a verifier bug must cost one reward, not the run
        log.warning("countdown verifier raised %s: %s", type(e).__name__, e)
        return Verdict.UNPARSABLE


def _verify(response: str, answer) -> Verdict:
    """verify() without its guard (the fuzz test counts what this raises)."""
    text = extract_answer(response)
    if text is None:
        return Verdict.UNPARSABLE
    try:
        tree = _parse(text)
    except CountdownParseError:
        return Verdict.UNPARSABLE
    if sorted(_leaves(tree)) != sorted(answer["nums"]):
        return Verdict.WRONG
    try:
        value = _value(tree)
    except CountdownParseError:  # well-formed but no value (division by zero): a wrong solution
        return Verdict.WRONG
    return Verdict.CORRECT if value == answer["target"] else Verdict.WRONG


def solve(nums: list[int], target: int) -> str | None:
    """An expression using every number exactly once that equals `target`, or None (exhaustive search)."""
    target = Fraction(target)
    dead: set[tuple] = set()  # multisets of values already known not to reach the target

    def search(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        key = tuple(sorted(v for v, _ in items))
        if key in dead:
            return None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                (a, ta), (b, tb) = items[i], items[j]
                rest = items[:i] + items[i + 1:j] + items[j + 1:]
                cands = [(a + b, f"({ta}+{tb})"), (a * b, f"({ta}*{tb})"),
                         (a - b, f"({ta}-{tb})"), (b - a, f"({tb}-{ta})")]
                if b:
                    cands.append((a / b, f"({ta}/{tb})"))
                if a:
                    cands.append((b / a, f"({tb}/{ta})"))
                for v, t in cands:
                    if abs(v.numerator) > MAX_MAGNITUDE or v.denominator > MAX_MAGNITUDE:
                        continue  # the verifier would refuse it
                    found = search(rest + [(v, t)])
                    if found:
                        return found
        dead.add(key)
        return None

    if not nums:
        return None
    text = search([(Fraction(n), str(n)) for n in nums])
    return text[1:-1] if text and text.startswith("(") else text  # the outer pair encloses the whole text
