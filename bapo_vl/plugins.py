"""Task plugins: a folder holding a `task.py` that defines

    NAME: str                                   # the task's name, e.g. "countdown"
    def load(split: str = "train", source: str | None = None, **options) -> list[Problem]
    def verify(response: str, answer) -> Verdict

Found in the bundled `tasks/` folder, in folders the user names, and in installed packages through the
`bapo_vl.tasks` entry-point group (the entry point names a module with the same three things).
Each plugin is checked when it is loaded; a broken one raises PluginError naming its path.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

BUNDLED = Path(importlib.import_module("bapo_vl.tasks").__file__).parent  # the repo's tasks/, installed as bapo_vl.tasks
TASK_FILE = "task.py"
ENTRY_POINT_GROUP = "bapo_vl.tasks"


class PluginError(Exception):
    def __init__(self, origin: str, problem: str):
        super().__init__(f"task plugin {origin}: {problem}")
        self.origin = origin


@dataclass
class Task:
    name: str
    load: Callable
    verify: Callable
    origin: str  # the folder or entry point it came from
    module: ModuleType


def _check(module: ModuleType, origin: str) -> Task:
    name = getattr(module, "NAME", None)
    if not isinstance(name, str) or not name:
        raise PluginError(origin, "defines no NAME string")
    for fn in ("load", "verify"):
        if not callable(getattr(module, fn, None)):
            raise PluginError(origin, f"defines no function {fn}()")
    return Task(name, module.load, module.verify, origin, module)


def load_folder(folder: Path) -> Task:
    path = Path(folder) / TASK_FILE
    spec = importlib.util.spec_from_file_location(f"bapo_vl_task_{Path(folder).name}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a broken plugin must name itself, not crash discovery
        raise PluginError(str(folder), f"{type(e).__name__}: {e}") from e
    return _check(module, str(folder))


def discover(extra_dirs=()) -> tuple[dict[str, Task], list[PluginError]]:
    """All tasks found, and the errors of the broken ones (which do not hide the others)."""
    tasks, errors = {}, []
    folders = [d for root in (BUNDLED, *map(Path, extra_dirs)) for d in sorted(Path(root).iterdir())
               if (d / TASK_FILE).is_file()]
    for folder in folders:
        try:
            task = load_folder(folder)
            tasks[task.name] = task
        except PluginError as e:
            errors.append(e)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            tasks.setdefault(ep.name, _check(ep.load(), f"entry point {ep.value}"))
        except Exception as e:
            errors.append(e if isinstance(e, PluginError) else PluginError(f"entry point {ep.value}", str(e)))
    return tasks, errors


_cache: dict[tuple, dict[str, Task]] = {}


def get_task(name: str, extra_dirs=()) -> Task:
    key = tuple(map(str, extra_dirs))
    if key not in _cache:
        _cache[key], errors = discover(extra_dirs)
    tasks = _cache[key]
    if name not in tasks:
        raise KeyError(f"unknown task {name!r}; found: {', '.join(sorted(tasks)) or 'none'}")
    return tasks[name]
