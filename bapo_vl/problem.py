"""What a task hands the trainer: problems, and what a verifier hands back: verdicts."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Verdict(str, enum.Enum):
    """Outcome of checking one response. Only CORRECT earns reward; the rest are counted separately
    so that a run of zeros caused by parsing or timeouts is visible (verifier health)."""

    CORRECT = "correct"
    WRONG = "wrong"
    UNPARSABLE = "unparsable"
    TIMEOUT = "timeout"

    @classmethod
    def of(cls, value) -> "Verdict":
        """A verdict from what a verifier returned: a Verdict, or its value ("correct", ...)."""
        return value if isinstance(value, cls) else cls(value)

    @property
    def reward(self) -> float:
        return 1.0 if self is Verdict.CORRECT else 0.0


@dataclass
class Problem:
    """One prompt x. `uid` is stable across runs (it keys buffers and the run record)."""

    uid: str
    messages: list[dict]  # chat messages, e.g. [{"role": "user", "content": "..."}]
    answer: Any  # ground truth, passed unchanged to the task's verifier
    images: list = field(default_factory=list)  # PIL images (vision-language tasks)
    meta: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The user turns as plain text (image parts dropped)."""
        parts = []
        for m in self.messages:
            if m.get("role") != "user":
                continue
            content = m["content"]
            if isinstance(content, str):
                parts.append(content)
            else:
                parts += [c["text"] for c in content if c.get("type") == "text"]
        return "\n".join(parts)
