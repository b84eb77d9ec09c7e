"""The package's import graph, read from the source (every `import`, at module level or inside a function): no
cycle, and no import from a backend back into the layers that run backends (the CLI, train, the launchers).

Could fail if a module under bapo_vl/backends imported bapo_vl.train again to run itself (verl_main did), or if two
modules imported each other, however lazily (the record and its reader did)."""
from __future__ import annotations

import ast
from pathlib import Path

import bapo_vl

ROOT = Path(bapo_vl.__file__).parents[1]
# the package's folders (pyproject.toml's package-dir): tasks/, verifiers/ and app/ install as subpackages
FOLDERS = {"bapo_vl": ROOT / "bapo_vl", "bapo_vl.tasks": ROOT / "tasks", "bapo_vl.verifiers": ROOT / "verifiers",
           "bapo_vl.app": ROOT / "app"}
LAUNCH_LAYER = {"bapo_vl.cli", "bapo_vl.train", "bapo_vl.verl_launch"}
# The verl backend's older entry point, kept for its commands: an entry point, not a backend; it imports the
# launcher (bapo_vl.verl_launch), never the CLI or train.
ENTRY_POINTS = {"bapo_vl.backends.verl_main": {"bapo_vl.verl_launch"}}


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = (package, *path.relative_to(folder).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (`from bapo_vl.x import y` counts x, and x.y where y is a module)."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {d for d in deps if d in mods and d != name and d != "bapo_vl"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_whole():
    graph = import_graph()
    assert {"bapo_vl.cli", "bapo_vl.config", "bapo_vl.backends.embedded", "bapo_vl.backends.verl_main"} <= set(graph)
    assert "bapo_vl.backends.embedded" in graph["bapo_vl.train"]  # a lazy import inside a function counts
    assert "bapo_vl.reader" in graph["bapo_vl.runs_cli"]
    assert "bapo_vl.verifiers.countdown" in graph["bapo_vl.tasks.countdown.task"]


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_cycles_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_backend_imports_the_layers_that_run_it():
    bad = {name: sorted(deps & LAUNCH_LAYER - ENTRY_POINTS.get(name, set()))
           for name, deps in import_graph().items() if name.startswith("bapo_vl.backends")}
    assert {name: deps for name, deps in bad.items() if deps} == {}
