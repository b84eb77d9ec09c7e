"""Named plug-in points — online filters, X2 promote rules, policy losses — all kept in one kind of registry."""
from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownName(KeyError, ValueError):
    """A name no plug-in was registered under (a KeyError for lookups, a ValueError for config checks)."""

    def __str__(self):
        return str(self.args[0])  # KeyError would quote the message


class Registry(dict, Generic[F]):
    """name -> function. `register(name)` decorates; `lookup(name)` names the registered ones when it fails.
    `source`: the module whose import registers the built-in entries, imported when the registry is first read, so
    that a module needing only the names (bapo_vl.config) does not import what the functions need (torch)."""

    def __init__(self, what: str, source: str | None = None):
        super().__init__()
        self.what = what
        self._source = source

    def _load(self):
        if self._source is not None:
            source, self._source = self._source, None
            importlib.import_module(source)

    def __contains__(self, name) -> bool:
        self._load()
        return super().__contains__(name)

    def __iter__(self):
        self._load()
        return super().__iter__()

    def __len__(self) -> int:
        self._load()
        return super().__len__()

    def __getitem__(self, name):
        self._load()
        return super().__getitem__(name)

    def get(self, name, default=None):
        self._load()
        return super().get(name, default)

    def keys(self):
        self._load()
        return super().keys()

    def items(self):
        self._load()
        return super().items()

    def values(self):
        self._load()
        return super().values()

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
