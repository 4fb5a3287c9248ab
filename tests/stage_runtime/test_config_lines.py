"""An error about a key of a TOML or JSON file names the line the key was written on
(stage_runtime._config_lines, and the loaders that use it)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime._config_lines import json_line, key_parts, toml_line, with_line
from stage_runtime.config import StageConfig
from stage_runtime.errors import ConfigError
from stage_runtime.pipeline import load_placement, load_topology

TOPOLOGY = """\
# a comment line
[defaults]
model_id = "m"
ctx_size = 8192

[defaults.kv_cache]
mode = "lookup-record"
max_entries = 256

[[stage]]
stage_id = "a"
layer_start = 0
layer_end = 4

[[stage]]
stage_id = "b"
layer_start = 4
layer_end = 8
[stage.kv_cache]
max_entries = 0

[placement]
engine = "ray"
num_cpus = 1
"stage-x".cpus = 2
resources = { stage-0 = { CPU = -1 } }
"""


@pytest.mark.parametrize(
    ("path", "line"),
    [
        ("defaults.ctx_size", 4),
        ("defaults.kv_cache.max_entries", 8),
        ("defaults.kv_cache", 6),  # a table: its header
        ("stage[0].layer_end", 13),
        ("stage[1].stage_id", 16),
        ("stage[1].kv_cache.max_entries", 20),  # a sub-table of the array's last element
        ("stage[0].kv_cache.max_entries", 10),  # not written there: its element's header
        ("stage[1].upstream", 15),
        ("placement.num_cpus", 24),
        ("placement['stage-x'].cpus", 25),  # a quoted, dotted key
        ("placement.resources['stage-0']['CPU']", 26),  # inside an inline table: its key
        ("placement.strategy", 22),  # missing: its table's header
    ],
)
def test_a_key_path_is_found_at_the_line_that_sets_it(path: str, line: int) -> None:
    assert toml_line(TOPOLOGY, key_parts(path)) == line


def test_a_key_path_nothing_of_which_is_in_the_file_has_no_line() -> None:
    assert toml_line(TOPOLOGY, key_parts("model.kind")) is None
    assert toml_line(TOPOLOGY, ()) is None


def test_key_parts_reads_indices_and_quoted_keys() -> None:
    assert key_parts("stage[1].kv_cache.max_entries") == ("stage", 1, "kv_cache", "max_entries")
    assert key_parts("resources['stage-0']['CPU']") == ("resources", "stage-0", "CPU")


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            "f.toml: stage[1].layer_start must be 4",
            "f.toml: line 17: stage[1].layer_start must be 4",
        ),
        ("f.toml: missing required field placement.address", "f.toml: line 22: missing required"),
        ("f.toml: unknown field defaults.kv_cache.x (known", "f.toml: line 6: unknown field"),
        ("f.toml: invalid TOML: Expected '=' (at line 3, column 5)", "f.toml: invalid TOML"),
        ("f.toml: line 2: config file must be UTF-8", "f.toml: line 2: config file"),
        ("f.toml: an integer of more than 4300 digits", "f.toml: an integer"),
        ("other.toml: stage[1].layer_start", "other.toml: stage[1]"),  # another file's
    ],
)
def test_with_line_adds_the_line_of_the_key_a_message_names(message: str, expected: str) -> None:
    assert with_line(message, "f.toml", TOPOLOGY).startswith(expected)


def test_the_loaders_name_file_line_and_key_path(tmp_path: Path) -> None:
    """load_topology, load_placement and StageConfig.load all say the line."""
    path = tmp_path / "topology.toml"
    path.write_text(TOPOLOGY.replace('"stage-x".cpus = 2\n', ""), encoding="utf-8")
    where = re.escape(str(path))
    with pytest.raises(ConfigError, match=rf"^{where}: line 20: stage\[1\]\.kv_cache\.max_entries"):
        load_topology(path)
    with pytest.raises(ConfigError, match=rf"^{where}: line 25: placement\.resources\['stage-0'\]"):
        load_placement(path)
    stage = tmp_path / "stage.toml"
    stage.write_text('stage_id = "s"\nmodel_id = "m"\nlayer_start = 0\n\nlayer_end = 0\n')
    where = re.escape(str(stage))
    with pytest.raises(ConfigError, match=rf"^{where}: line 5: layer_end must be > layer_start"):
        StageConfig.load(stage)


def test_a_table_named_by_an_empty_key_is_passed_over() -> None:
    """``[""]`` is valid TOML; it names nothing an error could name."""
    assert toml_line('[""]\nx = 1\n[a]\nb = 2\n', ("a", "b")) == 4


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("[].\"'=# \nab0-_{}")), max_size=120),
    path=st.text(alphabet=st.sampled_from(list("ab0[]'._-")), max_size=20),
)
def test_with_line_never_raises_whatever_the_text(text: str, path: str) -> None:
    """On any text (a TOML file that parsed, or not), the message comes back, at worst as is."""
    line = toml_line(text, key_parts(path))  # (never raises either)
    assert line is None or 1 <= line <= len(text.splitlines())
    message = f"f.toml: {path} must be something"
    located = with_line(message, "f.toml", text)
    assert located == message or located.startswith("f.toml: line ")
    assert located.endswith(f"{path} must be something")


_JSON = st.recursive(
    st.integers(-5, 5) | st.text(alphabet='ab"\\\n', max_size=4) | st.booleans() | st.none(),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet='ab-"\\', min_size=1, max_size=3), inner, max_size=3)
    ),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every key path in a JSON value (object keys and array indices)."""
    found = []
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, inner in items:
        found.append((*prefix, key))
        found.extend(_paths(inner, (*prefix, key)))
    return found


@settings(max_examples=200, deadline=None)
@given(document=st.dictionaries(st.text(alphabet="ab_", min_size=1, max_size=3), _JSON, max_size=4))
def test_json_line_finds_every_key_of_an_indented_document(document: dict[str, Any]) -> None:
    """In a document written one value per line, each object key is found on the line that
    names it, and each array element on a line of its array."""
    text = json.dumps(document, indent=1)
    lines = text.splitlines()
    for path in _paths(document):
        line = json_line(text, path)
        assert line is not None
        if isinstance(path[-1], str):
            assert json.dumps(path[-1]) + ":" in lines[line - 1]


def test_a_string_after_an_empty_object_is_a_value_not_a_key() -> None:
    """Found by the property above: ``{}`` then a string in an array."""
    text = json.dumps({"_": [{}, "", {"\\": None}]}, indent=1)
    assert json_line(text, ("_", 2, "\\")) == 6


def test_json_errors_name_the_line(tmp_path: Path) -> None:
    """StageConfig.load of a JSON file says the line of the bad key too."""
    stage = tmp_path / "stage.json"
    stage.write_text(
        '{\n "stage_id": "s",\n "model_id": "m",\n "layer_start": 0,\n "layer_end": 4,\n'
        ' "kv_cache": {\n  "mode": "lookup-record",\n  "max_entries": 0\n }\n}\n'
    )
    where = re.escape(str(stage))
    with pytest.raises(ConfigError, match=rf"^{where}: line 8: kv_cache\.max_entries must be"):
        StageConfig.load(stage)
    assert json_line(stage.read_text(), ("kv_cache", "min_tokens")) == 6  # missing: its object
