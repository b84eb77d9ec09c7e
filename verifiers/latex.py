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
                return text[i + 1:end].strip()
            stop = i
        else:
            bare = _BARE.match(text, i)
            if bare:
                return bare.group()
    return None
