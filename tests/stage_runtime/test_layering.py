"""Layering: no import circle anywhere in stage_runtime (DESIGN), the cache package included
(issue 20)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE = "stage_runtime.cache"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """Every stage_runtime module -> the stage_runtime modules it imports anywhere in its body
    (lazy imports inside functions included)."""
    paths = {_module_name(p): p for p in (ROOT / "stage_runtime").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            targets.update(f for f in found if f in paths and f != name)
        graph[name] = targets
    return graph


def _cycles_through(graph: dict[str, set[str]], prefix: str) -> list[list[str]]:
    """The strongly connected components (of more than one module) holding a module whose name
    starts with ``prefix`` (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 and any(m.startswith(prefix) for m in component):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cache_package_is_in_no_import_circle() -> None:
    """No chain of imports leads from a module of stage_runtime.cache back to itself."""
    graph = _import_graph()
    assert any(name.startswith(PACKAGE + ".") for name in graph)
    assert _cycles_through(graph, PACKAGE) == []


def test_no_module_of_the_package_is_in_an_import_circle() -> None:
    """Nor from any other module (the simulator's driver and fan-out used to import each
    other: the synchronous entry points now live in sim/runs.py, above both)."""
    assert _cycles_through(_import_graph(), "stage_runtime") == []


def test_the_circle_check_sees_a_circle() -> None:
    """The check itself finds a circle when there is one (including lazy imports)."""
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "b": {"a.x"}}
    assert _cycles_through(graph, "a.") == [["a.x", "a.y", "a.z"]]
    assert _cycles_through(graph, "b") == []
