"""The exception hierarchy of :mod:`stage_runtime`.

Every error the library raises on purpose derives from :class:`StageRuntimeError`. The ones about
bad input are also :class:`ValueError` so that callers catching the standard type still see them.
"""

from __future__ import annotations

import json
from typing import overload

__all__ = [
    "ConfigError",
    "FrameError",
    "PipelineStoppedError",
    "StageFailedError",
    "StageRuntimeError",
    "TraceFormatError",
]


class StageRuntimeError(Exception):
    """Base class of every error raised by stage-runtime."""


class ConfigError(StageRuntimeError, ValueError):
    """A configuration value or argument is invalid; the message names the field and value."""


class FrameError(StageRuntimeError, ValueError):
    """An activation frame is malformed; the message names the field and value."""


class TraceFormatError(StageRuntimeError, ValueError):
    """A request-trace line is malformed; the message names the file, line and field."""

    def __init__(self, message: str, *, path: str = "", line: int = 0, field: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.line = line
        self.field = field


class StageFailedError(StageRuntimeError):
    """A stage task raised an unexpected exception; the original is ``__cause__``."""

    def __init__(self, message: str, *, stage_id: str = "") -> None:
        super().__init__(message)
        self.stage_id = stage_id


class PipelineStoppedError(StageRuntimeError):
    """The pipeline stopped (a stage crashed, or the pipeline closed) before a request finished.

    Not the request's fault: the same request may succeed on another pipeline.
    """


@overload
def sole_exception(exc: Exception) -> Exception: ...


@overload
def sole_exception(exc: BaseException) -> BaseException: ...


def sole_exception(exc: BaseException) -> BaseException:
    """The single exception inside (nested) one-member groups, else ``exc`` itself (an
    ``Exception`` stays one: an ``ExceptionGroup`` holds only those)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


SHOWN_CHARS = 80
"""Longest quoted value in an error message (a bad value can be megabytes long)."""


def shown(value: object) -> str:
    """``repr(value)`` for an error message, cut to :data:`SHOWN_CHARS` characters."""
    try:
        text = repr(value)
    except ValueError:  # an int past int-to-str's 4,300-digit limit
        digits = int(value.bit_length() * 0.30103) + 1 if isinstance(value, int) else 0
        return f"an integer of about {digits:,} digits"
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[: SHOWN_CHARS - 3]}... ({len(text):,} characters)"


def shown_json(value: object) -> str:
    """A value read from JSON, spelled as JSON writes it (``null``, ``true``, ``"soon"``,
    ``Infinity``) for an error about a JSON file, cut as :func:`shown` cuts."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON's (or an int past int-to-str's limit)
        return shown(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[: SHOWN_CHARS - 3]}... ({len(text):,} characters)"


def json_error_detail(exc: json.JSONDecodeError, *, one_line: bool) -> str:
    """What a JSON syntax error is and where, in words a user can act on.

    ``json`` leaves the position out of ``exc.msg`` ("Invalid control character at") and says
    nothing of why a string is unterminated; this puts the column (and the line, unless the text
    is ``one_line``, as a trace line is) where it belongs.
    """
    where = f"column {exc.colno}" if one_line else f"line {exc.lineno} column {exc.colno}"
    if exc.msg.startswith("Unterminated string"):
        scope = "on this line" if one_line else "before the end"
        return f"the string opened at {where} is not closed {scope}"
    if exc.msg.startswith("Invalid control character"):
        code = f"{ord(exc.doc[exc.pos]):04X}" if exc.pos < len(exc.doc) else "?"
        return (
            f"a control character (U+{code}) at {where} inside a string: "
            f"escape it, as \\u{code.lower()}"
        )
    message = exc.msg.removesuffix(" at")
    return f"{message[:1].lower()}{message[1:]} at {where}"
