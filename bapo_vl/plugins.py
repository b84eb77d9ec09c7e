"""Task plugins. The contract - a plugin is a folder holding a `task.py` (or an installed module named by a
`bapo_vl.tasks` entry point) that defines:

    NAME: str
        The task's name, `task=NAME` in a config. Unique among all plugins found.

    def load(split: str = "train", source: str | None = None, **options) -> list[Problem]
        The problems of `split` ("train" for training; any name in EVAL_SPLITS for `bapo eval`), read from
        `source` (a file or folder) or built in when None. `options` come from `task_options` in the config
        (e.g. template, limit). Each Problem has a stable uid.

    def verify(response: str, answer) -> Verdict
        Check one decoded response against `Problem.answer`. Only Verdict.CORRECT earns reward; an
        exception counts as UNPARSABLE.

    EVAL_SPLITS: list[str] = []                  (optional)
        Split names load() accepts that `bapo eval` evaluates on by default, e.g. ["cd34", "cd4"].

    VERSION: str = ""                            (optional)
        The verifier's version, stored in each run record (meta `verifier_version`) and eval result: bump it
        whenever verify() can judge a response differently.

    def verify_batch(responses: list[str], answers: list) -> list[Verdict]    (optional)
        Many responses at once (e.g. in parallel); the trainer and `bapo eval` use it when present. If it
        raises, each response is verified alone with verify().

Where plugins are found, in this order: the bundled `tasks/` folder (installed as bapo_vl.tasks), the extra
folders of `tasks_dirs` / `--tasks-dir` (each a folder of plugin folders, or a plugin folder itself), and
installed packages through the `bapo_vl.tasks` entry-point group (`name = "package.module"`).

Each plugin is checked against the contract when it is loaded, not at first call: NAME a non-empty str,
load/verify callable, load accepting `split=` and `source=` keywords, verify taking (response, answer),
EVAL_SPLITS a list of str. A broken plugin raises PluginError naming its folder (or entry point) and what is
wrong; discover() collects those errors without hiding the other plugins. Two plugins with the same NAME are
an error naming both origins: the first found stays listed, and get_task refuses the ambiguous name.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

BUNDLED = Path(importlib.import_module("bapo_vl.tasks").__file__).parent  # the repo's tasks/, installed as bapo_vl.tasks
TASK_FILE = "task.py"
ENTRY_POINT_GROUP = "bapo_vl.tasks"


class PluginError(Exception):
    """A plugin that breaks the contract; `origin` is its folder or entry point."""

    def __init__(self, origin: str, problem: str, name: str | None = None):
        super().__init__(f"task plugin {origin}: {problem}")
        self.origin, self.problem = origin, problem
        self.name = name  # set when the plugin's NAME is known (duplicates)


@dataclass
class Task:
    name: str
    load: Callable
    verify: Callable
    origin: str  # the folder or entry point it came from
    module: ModuleType
    eval_splits: list[str] = field(default_factory=list)
    version: str = ""
    verify_batch: Callable | None = None


def accepts(fn, *args, **kwargs) -> bool:
    """Whether fn(*args, **kwargs) binds to fn's signature (True when the signature cannot be read)."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # some builtins have no readable signature
        return True
    return True


def check_load_options(task: Task, options: dict, where: str) -> None:
    """Refuse options the task's load() takes no keyword for, naming them and those it takes (`where`: how the
    user gave them), rather than let load() fail with Python's TypeError."""
    if accepts(task.load, split="train", **options):
        return
    params = inspect.signature(task.load).parameters
    unknown = sorted(set(options) - set(params))
    takes = ", ".join(p for p in params if p != "split") or "none"
    raise ValueError(f"{where}: task {task.name}'s load() takes no option {', '.join(map(repr, unknown))} "
                     f"(it takes: {takes}); drop it")


def _eval_splits(value, origin: str) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise PluginError(origin, f"EVAL_SPLITS must be a list of split names (str), got {value!r}")
    return list(value)


def check(module, origin: str) -> Task:
    """The Task a plugin module defines, or PluginError(origin, what is wrong) if it breaks the contract."""
    name = getattr(module, "NAME", None)
    if not isinstance(name, str) or not name:
        raise PluginError(origin, f"NAME must be a non-empty str, got {name!r}")
    for fn in ("load", "verify"):
        if not callable(getattr(module, fn, None)):
            raise PluginError(origin, f"defines no function {fn}()")
    if not accepts(module.load, split="train", source=None):
        raise PluginError(origin, "load() must accept the keywords split= and source=: "
                                  "def load(split='train', source=None, **options)")
    if not accepts(module.verify, "response", None):
        raise PluginError(origin, "verify() must take (response, answer)")
    splits = _eval_splits(getattr(module, "EVAL_SPLITS", []), origin)
    version = getattr(module, "VERSION", "")
    if not isinstance(version, str):
        raise PluginError(origin, f"VERSION must be a str, got {version!r}")
    batch = getattr(module, "verify_batch", None)
    if batch is not None and not (callable(batch) and accepts(batch, ["response"], [None])):
        raise PluginError(origin, "verify_batch() must take (responses, answers), two lists")
    return Task(name, module.load, module.verify, origin, module, splits, version, batch)


def load_folder(folder) -> Task:
    """Import `folder/task.py` (as a module of its own, registered in sys.modules) and check it."""
    folder = Path(folder)
    path = folder / TASK_FILE
    if not path.is_file():
        raise PluginError(str(folder), f"no {TASK_FILE} in this folder")
    # a name unique to the file, so two folders both called `mytask` do not replace each other's module
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    module_name = "bapo_vl_task_" + re.sub(r"\W", "_", folder.name) + "_" + digest
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # a broken plugin must name itself, not crash discovery (SystemExit included)
        sys.modules.pop(module_name, None)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise PluginError(str(folder), f"{type(e).__name__}: {e}") from e
    return check(module, str(folder))


def plugin_folders(root) -> list[Path]:
    """`root` itself if it holds a task.py, else its subfolders that do (sorted by name)."""
    root = Path(root)
    if (root / TASK_FILE).is_file():
        return [root]
    return [d for d in sorted(root.iterdir()) if (d / TASK_FILE).is_file()]


def _entry_points():
    """(origin, loader) per `bapo_vl.tasks` entry point of the installed packages."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        where = f" (package {dist.name})" if dist is not None else ""
        yield f"entry point {ep.name} = {ep.value}{where}", ep.load


def _source_file(task: Task) -> str | None:
    file = getattr(task.module, "__file__", None)
    return str(Path(file).resolve()) if file else None


def discover(extra_dirs=()) -> tuple[dict[str, Task], list[PluginError]]:
    """All tasks found, by name, and the errors of the broken or duplicate ones (which hide no other)."""
    tasks: dict[str, Task] = {}
    errors: list[PluginError] = []
    seen_files: set[str] = set()  # the same task.py reached twice (a folder named twice) is one plugin

    def add(task: Task):
        file = _source_file(task)
        if file is not None:
            if file in seen_files:
                return
            seen_files.add(file)
        if task.name in tasks:
            errors.append(PluginError(task.origin, f"NAME {task.name!r} is already defined by "
                                                   f"{tasks[task.name].origin}; rename one of them", task.name))
            return
        tasks[task.name] = task

    folders: list[Path] = []
    for root in (BUNDLED, *map(Path, extra_dirs)):
        if not root.is_dir():
            errors.append(PluginError(str(root), "no such folder (named in tasks_dirs / --tasks-dir)"))
            continue
        folders += plugin_folders(root)
    for folder in folders:
        try:
            add(load_folder(folder))
        except PluginError as e:
            errors.append(e)
    for origin, load in _entry_points():
        try:
            add(check(load(), origin))
        except PluginError as e:
            errors.append(e)
        except Exception as e:  # noqa: BLE001 - an entry point that fails to import
            errors.append(PluginError(origin, f"{type(e).__name__}: {e}"))
    return tasks, errors


_cache: dict[tuple, tuple[dict[str, Task], list[PluginError]]] = {}


def get_task(name: str, extra_dirs=()) -> Task:
    """The task called `name`. Discovery is cached per set of extra folders and redone when `name` is not
    in the cache, so a plugin folder written later in the same process is found."""
    key = tuple(str(Path(d).resolve()) for d in extra_dirs)
    if key not in _cache or name not in _cache[key][0]:
        _cache[key] = discover(extra_dirs)
    tasks, errors = _cache[key]
    duplicate = [e for e in errors if e.name == name]
    if duplicate:
        raise duplicate[0]
    if name not in tasks:
        broken = "; ".join(str(e) for e in errors)
        raise KeyError(f"unknown task {name!r}; found: {', '.join(sorted(tasks)) or 'none'}"
                       + (f" (broken: {broken})" if broken else ""))
    return tasks[name]
