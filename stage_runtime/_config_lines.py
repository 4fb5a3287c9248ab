"""Where in a TOML or JSON file a key path was written: the line an error about it names.

``tomllib`` and ``json`` give values without positions, and the loaders report errors by key
path (``stage[1].kv_cache.max_entries``). :func:`with_line` finds that key's line by scanning
the text once.

- :func:`toml_line` reads table headers (``[a.b]``, ``[[a]]`` with their positions), then each
  ``key = ...`` under them. It is a locator, not a parser: a key set inside an inline table
  (``resources = { stage-0 = { CPU = -1 } }``) is found at its outermost key's line, a missing
  key at its table's header; lines inside multi-line strings and arrays could mislead it.
- :func:`json_line` follows the document's objects and arrays, token by token.

When nothing matches, the message is left without a line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Final

__all__ = ["json_line", "key_parts", "toml_line", "with_line"]

_Part = str | int

_PATH_PART: Final = re.compile(r"\[(\d+)\]|\['((?:[^'\\]|\\.)*)'\]|\.?([A-Za-z0-9_-]+)")
_MESSAGE_PATH: Final = re.compile(
    r"(?:missing required field |unknown field )?"
    r"(?P<path>[A-Za-z_][A-Za-z0-9_-]*(?:\[\d+\]|\['(?:[^'\\]|\\.)*'\]|\.[A-Za-z0-9_-]+)*)"
)
_HEADER: Final = re.compile(r"^\[(\[)?\s*(?P<name>[^\[\]]+?)\s*\](\])?\s*(#.*)?$")
_ASSIGNMENT: Final = re.compile(
    r"^(?P<key>(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*'))*)\s*="
)
_DOTTED: Final = re.compile(r"\s*(?:([A-Za-z0-9_-]+)|\"([^\"]*)\"|'([^']*)')\s*(?:\.|$)")


class _Nearest:
    """The line of the longest leading part of ``path`` seen so far (the first such line)."""

    def __init__(self, path: tuple[_Part, ...]) -> None:
        self.path = path
        self.depth = 0
        self.line: int | None = None

    def saw(self, here: tuple[_Part, ...], line: int) -> None:
        """Line ``line`` sets key path ``here``."""
        if len(here) > self.depth and self.path[: len(here)] == here:
            self.depth, self.line = len(here), line


def key_parts(path: str) -> tuple[_Part, ...]:
    """``"stage[1].kv_cache.max_entries"`` as ``("stage", 1, "kv_cache", "max_entries")``
    (``resources['stage-0']`` as ``("resources", "stage-0")``)."""
    parts: list[_Part] = []
    for index, quoted, bare in _PATH_PART.findall(path):
        if index:
            parts.append(int(index))
        elif bare:
            parts.append(bare)
        else:
            parts.append(quoted)
    return tuple(parts)


def _dotted(key: str) -> tuple[str, ...]:
    """A TOML dotted key (``a."b.c".d``) as its parts."""
    return tuple(a or b or c for a, b, c in _DOTTED.findall(key) if a or b or c)


def toml_line(text: str, path: tuple[_Part, ...]) -> int | None:
    """The 1-based line of ``text`` that sets the longest leading part of ``path`` (a key, or
    a table's header); None when not even its first key is there."""
    table: tuple[_Part, ...] = ()
    arrays: dict[tuple[_Part, ...], int] = {}  # each array of tables: the index of its last
    nearest = _Nearest(path)
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        header = _HEADER.match(line)
        if header is not None and line.startswith("["):
            name = _dotted(header["name"])
            if not name:  # [""]: a table named by an empty key, which no error path names
                continue
            here: tuple[_Part, ...] = ()
            for part in name[:-1]:  # a sub-table of the last element of an array of tables
                here += (part,)
                if here in arrays:
                    here += (arrays[here],)
            here += (name[-1],)
            if header.group(1):  # [[array]]
                arrays[here] = arrays.get(here, -1) + 1
                here += (arrays[here],)
            table = here
        else:
            assignment = _ASSIGNMENT.match(line)
            if assignment is None:
                continue
            here = (*table, *_dotted(assignment["key"]))
        nearest.saw(here, number)
    return nearest.line


def _string_end(text: str, start: int) -> int:
    """The index just after the JSON string that opens at ``text[start]`` (a ``"``)."""
    index = start + 1
    while True:
        char = text[index]  # (an unterminated string: IndexError, which with_line catches)
        if char == "\\":
            index += 2
        elif char == '"':
            return index + 1
        else:
            index += 1


def json_line(text: str, path: tuple[_Part, ...]) -> int | None:
    """The 1-based line of JSON ``text`` that holds the longest leading part of ``path`` (an
    object's key, or an array's element); None when not even its first key is there."""
    where: list[_Part] = []  # the path of the value being read: a key or index per container
    nearest = _Nearest(path)
    index, line, size = 0, 1, len(text)
    expect_key = False
    while index < size:
        char = text[index]
        if char == "\n":
            line += 1
        elif char == '"':
            end = _string_end(text, index)
            value = json.loads(text[index:end])
            line += text.count("\n", index, end)
            if expect_key:
                where[-1] = value
                nearest.saw(tuple(where), line)
                expect_key = False
            index = end
            continue
        elif char == "{":
            where.append("")
            expect_key = True
        elif char == "[":
            where.append(0)
            nearest.saw(tuple(where), line)
        elif char in "}]" and where:
            where.pop()
            expect_key = False  # (an empty object awaited a key that never came)
        elif char == "," and where:
            if isinstance(where[-1], int):
                where[-1] += 1
                nearest.saw(tuple(where), line)
            else:
                expect_key = True
        index += 1
    return nearest.line


def with_line(
    message: str,
    source: str,
    text: str,
    locate: Callable[[str, tuple[_Part, ...]], int | None] = toml_line,
) -> str:
    """``message`` (``"{source}: {key path} ..."``) with the line that key path was written
    on (found by ``locate``: :func:`toml_line` or :func:`json_line`): ``"{source}: line {n}:
    ..."``; unchanged when it names no key found in ``text`` or already has a line."""
    prefix = f"{source}: "
    if not message.startswith(prefix):
        return message
    rest = message[len(prefix) :]
    found = _MESSAGE_PATH.match(rest)
    if found is None or rest.startswith(("line ", "invalid TOML", "invalid JSON")):
        return message
    try:
        line = locate(text, key_parts(found["path"]))
    except Exception:  # a locator must never hide the error it decorates
        return message
    return message if line is None else f"{prefix}line {line}: {rest}"
