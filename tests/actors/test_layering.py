"""Layering: the actors package stands alone and never imports stage_runtime."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "actors"


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
    return names


def test_no_actors_module_imports_stage_runtime() -> None:
    """No import statement anywhere in actors/ names stage_runtime (not even a lazy one)."""
    sources = sorted(PACKAGE.glob("*.py"))
    assert PACKAGE / "testing.py" in sources
    offending = {
        f"{path.name}: {name}"
        for path in sources
        for name in _imported_modules(path)
        if name == "stage_runtime" or name.startswith("stage_runtime.")
    }
    assert offending == set()


def test_importing_actors_loads_no_stage_runtime_module() -> None:
    """A fresh interpreter importing actors and actors.testing loads no stage_runtime module."""
    code = (
        "import sys, actors, actors.testing\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'stage_runtime'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
