"""What a settings field accepts, declared with the field (`within`) and checked by bapo_vl.config. Torch-free and
apart from config, so that bapo_vl.loss_config declares the loss fields, once, the same way."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Range:
    """The numbers a field takes: above gt / from ge, below lt / up to le (None: no bound on that side)."""
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def __contains__(self, x) -> bool:
        return ((self.gt is None or x > self.gt) and (self.ge is None or x >= self.ge)
                and (self.lt is None or x < self.lt) and (self.le is None or x <= self.le))

    def __str__(self) -> str:
        bounds = ((">", self.gt), (">=", self.ge), ("<", self.lt), ("<=", self.le))
        return " and ".join(f"{op} {bound:g}" for op, bound in bounds if bound is not None)


def within(default, accepted, hint: str = "", key: str | None = None):
    """A settings field whose values must be `in accepted`: a Range, or the names it takes (a tuple, or a registry,
    so that a newly registered name counts). For a list or pair field, each item. `hint` ends the error message;
    `key` is the field's name in key=value, presets and run records where its attribute name would be unclear."""
    meta = {"accepted": accepted, "hint": hint, **({"key": key} if key else {})}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.copy(default), metadata=meta)
    return field(default=default, metadata=meta)
