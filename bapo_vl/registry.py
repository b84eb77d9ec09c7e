"""Named plug-in points — online filters, X2 promote rules, policy losses — all kept in one kind of registry."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownName(KeyError, ValueError):
    """A name no plug-in was registered under (a KeyError for lookups, a ValueError for config checks)."""

    def __str__(self):
        return str(self.args[0])  # KeyError would quote the message


class Registry(dict, Generic[F]):
    """name -> function. `register(name)` decorates; `lookup(name)` names the registered ones when it fails."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def register(self, name: str) -> Callable[[F], F]:
        def wrap(fn: F) -> F:
            if self.get(name) not in (None, fn):
                raise ValueError(f"{self.what} {name!r} is already registered ({self[name].__qualname__})")
            self[name] = fn
            return fn
        return wrap

    def lookup(self, name: str) -> F:
        if name not in self:
            raise UnknownName(f"unknown {self.what} {name!r}; known: {', '.join(self)}")
        return self[name]
