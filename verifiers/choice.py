"""Multiple-choice answers: the chosen letter, from <answer> tags, \\boxed{}, or a final "Answer: X" line."""
from __future__ import annotations

import re

from bapo_vl.problem import Verdict

MAX_CHARS = 20_000
_PATTERNS = [
    re.compile(r"<answer>\s*\(?([A-Z])\)?[\s.:)]*(?:</answer>|$)", re.I),
    re.compile(r"\\boxed\{\s*\(?([A-Z])\)?\s*\}"),
    re.compile(r"answer\s*(?:is)?\s*[:：]?\s*\(?([A-Z])\)?\b", re.I),
]


def extract_choice(response: str, letters: str = "ABCD") -> str | None:
    """The last choice letter stated as the answer, or None.

    >>> extract_choice("so x = 15. <answer>C</answer>")
    'C'
    """
    text = response[-MAX_CHARS:]
    for pattern in _PATTERNS:
        found = [m.upper() for m in pattern.findall(text) if m.upper() in letters]
        if found:
            return found[-1]
    return None


def verify(response: str, answer: str, letters: str = "ABCD") -> Verdict:
    choice = extract_choice(response, letters)
    if choice is None:
        return Verdict.UNPARSABLE
    return Verdict.CORRECT if choice == answer.strip().upper() else Verdict.WRONG
