"""The error hierarchy is the one users catch."""

from __future__ import annotations

import pytest

from stage_runtime import (
    ConfigError,
    FrameError,
    StageFailedError,
    StageRuntimeError,
    TraceFormatError,
)


@pytest.mark.parametrize("cls", [ConfigError, FrameError, TraceFormatError])
def test_input_errors_are_value_errors(cls: type[StageRuntimeError]) -> None:
    """Bad-input errors are both StageRuntimeError and ValueError."""
    assert issubclass(cls, StageRuntimeError)
    assert issubclass(cls, ValueError)


def test_trace_format_error_keeps_location() -> None:
    """A TraceFormatError carries file, line and field for programs that report them."""
    err = TraceFormatError("bad", path="t.jsonl", line=3, field="hash_ids")
    assert (err.path, err.line, err.field) == ("t.jsonl", 3, "hash_ids")


def test_stage_failed_error_is_not_a_value_error() -> None:
    """A stage crash is a bug, not bad input."""
    assert not issubclass(StageFailedError, ValueError)
