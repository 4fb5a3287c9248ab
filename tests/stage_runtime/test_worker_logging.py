"""The log lines of the processes a driver starts (stage processes, replay units)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from stage_runtime.placement.worker_logging import one_word_json, stderr_json_logging

_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@given(st.dictionaries(st.text(), _VALUES, max_size=6))
def test_a_line_is_one_word_of_the_same_json(event: dict[str, Any]) -> None:
    """No whitespace splits a line (Python's split, which Ray's log merging uses), and it
    parses back to the event, spaces in strings included."""
    line = one_word_json(event)
    assert line.split() == [line]
    assert json.loads(line) == event


def test_ray_never_merges_two_stages_lines() -> None:
    """Ray drops the words holding digits from each forwarded line and merges lines from two
    processes that are then equal: two stages' events differ only in digits. As one word with
    a timestamp, a line keeps nothing to merge on."""
    ray_logging = pytest.importorskip("ray._private.ray_logging")
    lines = []
    for stage in ("stage-0", "stage-1"):
        out = io.StringIO()
        stderr_json_logging(20)
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(out))
        structlog.get_logger().info("stage_started", stage=stage, note="a few words")
        lines.append(out.getvalue().strip())
    assert [json.loads(line)["stage"] for line in lines] == ["stage-0", "stage-1"]
    assert [ray_logging._canonicalise_log_line(line) for line in lines] == ["", ""]


def test_a_workers_tracebacks_leave_out_local_variables() -> None:
    """A stage process's error lines carry the traceback without each frame's locals (they
    held whole pipelines and requests)."""
    out = io.StringIO()
    saved = structlog.get_config()
    try:
        stderr_json_logging(20)
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(out))
        secret_local = "x" * 40  # noqa: F841 - a local the traceback must not print
        try:
            raise RuntimeError("stage bug")
        except RuntimeError:
            structlog.get_logger().error("stage_failed", exc_info=True)
    finally:
        structlog.reset_defaults()
        structlog.configure(**saved)
    line = out.getvalue().strip()
    [error] = json.loads(line)["exception"]
    assert error["exc_value"] == "stage bug"
    assert "xxxxxxxxxx" not in line
