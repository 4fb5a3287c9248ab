"""A Sphinx directive that renders benchmark results committed as JSON, so no figure in the
documentation is typed by hand.

``benchmark-goals`` reads the JSON ``benchmarks/run.py`` writes and renders one row per goal a
benchmark recorded (benchmark, goal, target, measured, verdict), through the same
``goal_rows`` function ``run.py`` prints its own table with; a caption names the machine,
versions and date of the run::

    ```{benchmark-goals} benchmarks/results.json
    ```

``benchmark-values`` renders a table of figures picked from the same file: the ``:header:``
option and each content line are cells separated by ``|``; ``{dotted.path:format}`` in a cell
is the value at that path (list items by index), formatted with Python's format mini-language.
A path that the file does not hold fails the build::

    ```{benchmark-values} benchmarks/results.json
    :header: run | seconds
    cold | {benchmarks.llama.result.cold.median_s:.3g}
    ```
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

_RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"


def _run_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_benchmarks_run", _RUN)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table(header: list[str], rows: list[list[str]]) -> nodes.table:
    table = nodes.table()
    group = nodes.tgroup(cols=len(header))
    table += group
    for _ in header:
        group += nodes.colspec(colwidth=1)
    head = nodes.thead()
    body = nodes.tbody()
    group += head
    group += body
    for parent, cells in [(head, header), *((body, row) for row in rows)]:
        row_node = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            entry += nodes.paragraph(text=cell)
            row_node += entry
        parent += row_node
    return table


class BenchmarkGoals(SphinxDirective):
    """Render the goals of a ``benchmarks/run.py`` results file as a table."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        relative = self.arguments[0]
        path = Path(self.env.srcdir) / relative
        self.env.note_dependency(str(path))
        try:
            document: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            msg = f"benchmark-goals: cannot read {relative}: {error}"
            raise self.error(msg) from error
        goal_rows = _run_module().goal_rows
        rows: list[list[str]] = []
        for name, entry in document.get("benchmarks", {}).items():
            if entry.get("status") != "ok":
                rows.append([name, "(not run)", "", entry.get("reason", ""), entry["status"]])
                continue
            for bench, goal, target, measured, verdict in goal_rows(name, entry["result"]):
                rows.append([bench, goal, target, measured, verdict])
        if not rows:
            msg = f"benchmark-goals: {relative} records no goal"
            raise self.error(msg)
        machine = document.get("machine", {})
        caption = ", ".join(f"{key} {value}" for key, value in machine.items())
        if document.get("date"):
            caption = f"{document['date']}: {caption}"
        met = sum(row[4] == "MET" for row in rows)
        summary = nodes.paragraph(text=f"{met} of {len(rows)} goals met. Run of {caption}.")
        return [_table(["benchmark", "goal", "target", "measured", "verdict"], rows), summary]


_FIELD = re.compile(r"\{([A-Za-z0-9_.\-]+)(?::([^{}]*))?\}")


def _lookup(document: object, path: str) -> object:
    value = document
    for key in path.split("."):
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        elif isinstance(value, dict) and key in value:
            value = value[key]
        else:
            msg = f"no {key!r} at {path!r}"
            raise KeyError(msg)
    return value


class BenchmarkValues(SphinxDirective):
    """Render figures picked from a benchmark JSON file as a table."""

    required_arguments = 1
    has_content = True
    option_spec = {"header": str}  # noqa: RUF012 (docutils' class attribute)

    def run(self) -> list[nodes.Node]:
        relative = self.arguments[0]
        path = Path(self.env.srcdir) / relative
        self.env.note_dependency(str(path))
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            msg = f"benchmark-values: cannot read {relative}: {error}"
            raise self.error(msg) from error

        def fill(cell: str) -> str:
            def one(match: re.Match[str]) -> str:
                value = _lookup(document, match[1])
                return format(value, match[2] or "")

            return _FIELD.sub(one, cell.strip())

        header = [cell.strip() for cell in self.options.get("header", "").split("|")]
        try:
            rows = [[fill(cell) for cell in line.split("|")] for line in self.content if line]
        except (KeyError, ValueError, TypeError) as error:
            msg = f"benchmark-values: {relative}: {error}"
            raise self.error(msg) from error
        if any(len(row) != len(header) for row in rows):
            msg = "benchmark-values: every row needs as many cells as the header"
            raise self.error(msg)
        return [_table(header, rows)]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("benchmark-goals", BenchmarkGoals)
    app.add_directive("benchmark-values", BenchmarkValues)
    return {"parallel_read_safe": True, "version": "1"}
