"""LaTeX scanning shared by the verifiers and the math task: brace matching and the last \\boxed{...}.

Model output is hostile input: both scans are iterative (no recursion) and linear in the length of the text,
however many boxes it holds (see last_boxed).
"""
from __future__ import annotations

import re
from collections import deque

BOX_TRIES = 20  # boxes looked at, from the last one back

_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_BRACE = re.compile(r"\\.|[{}]", re.S)  # an escape (\{, \}, \\) is one token, so it never opens or closes
_BARE = re.compile(r"[^\s$]+")


def match_brace(text: str, i: int, stop: int | None = None) -> int | None:
    """Index of the brace closing the "{" at text[i] (escaped braces skipped), or None if it is not closed
    (before index `stop`, if given)."""
    depth = 0
    for m in _BRACE.finditer(text, i, len(text) if stop is None else stop):
        t = m.group()
        if t == "{":
            depth += 1
        elif t == "}":
            depth -= 1
            if depth == 0:
                return m.start()
    return None


def last_boxed(text: str, tries: int = BOX_TRIES) -> str | None:
    """The content of the last \\boxed{...} or \\fbox{...} in `text`, stripped; None if there is none.

    An unclosed box gives way to the one before it, as a response cut off inside its box still has its earlier
    answer ("\\boxed{1} then \\boxed{\\frac{1}{2}} and \\boxed{3" gives "\\frac{1}{2}"); "\\boxed 5" (no
    braces) gives "5". Only the last `tries` boxes are looked at.
    """
    found = _last_box(text, tries)
    return None if found is None else text[found[1]:found[2]].strip()


def _last_box(text: str, tries: int = BOX_TRIES) -> tuple[int, int, int] | None:
    """last_boxed's box: (start of the command, start and end of the content), unstripped."""
    if not isinstance(text, str):
        return None
    # A box still open at the end of the text also keeps every earlier box open past its "{", so an earlier
    # box need only be scanned up to there: all the scans together read the text about once.
    stop = len(text)
    for m in reversed(deque(_BOX.finditer(text), maxlen=tries)):
        i = m.end()
        while text[i:i + 1] in (" ", "\t"):
            i += 1
        if text[i:i + 1] == "{":
            end = match_brace(text, i, stop)
            if end is not None:
                return m.start(), i + 1, end
            stop = i
        else:
            bare = _BARE.match(text, i)
            if bare:
                return m.start(), bare.start(), bare.end()
    return None


_BOX_OR_BRACE = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])[ \t]*\{|\\.|[{}]", re.S)


def final_box(text: str, tries: int = BOX_TRIES) -> tuple[int, int, int] | None:
    """The box that holds the final answer: (start of its command, start and end of its content, unstripped).
    It is last_boxed's box, or the outermost closed box around it when it sits in another:
    "\\boxed{\\boxed{5} \\text{ or } \\boxed{6}}" gives the whole hedge, not "6". One pass over the braces."""
    last = _last_box(text, tries)
    if last is None or text[last[1] - 1:last[1]] != "{" or _BOX.search(text, 0, last[0]) is None:
        return last
    around = None  # the boxes open around the last box (where their commands start), outermost first
    braces: list[int | None] = []  # the open braces: the box each one opens (its command start), or None
    closes = {}  # box -> where its content ends
    for m in _BOX_OR_BRACE.finditer(text):
        token = m.group()
        if len(token) > 2:  # "\\boxed{" (an escape such as "\\{" is two characters: it neither opens nor closes)
            if m.start() == last[0]:
                around = [b for b in braces if b is not None]
            braces.append(m.start())
        elif token == "{":
            braces.append(None)
        elif token == "}" and braces:
            box = braces.pop()
            if box is not None:
                closes[box] = m.start()
    for start in around or ():
        if closes.get(start, -1) >= last[2]:  # the outermost box that closes around the last one holds it
            return start, _BOX_OR_BRACE.match(text, start).end(), closes[start]
    return last
