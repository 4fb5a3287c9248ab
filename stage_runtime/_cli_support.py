"""What the command lines share: logging setup and argument types.

``stage-runtime`` (:mod:`stage_runtime.cli`) and its ``serve`` subcommand
(:mod:`stage_runtime.server.command`) configure structlog the same way (stderr, UTC ISO
timestamps, a console renderer on a terminal and JSON lines otherwise) and word their argument
errors the same way (``must be ..., got X``). Library code never calls these.
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import structlog

from stage_runtime.placement.worker_logging import JSON_TRACEBACKS

LOG_LEVELS = ("debug", "info", "warning", "error")
"""Level names accepted by :func:`configure_logging`, lowest first."""


def unreadable(path: str | Path) -> str | None:
    """Why the command cannot read the file ``path`` (``no such file``, ``it is a directory``,
    ``permission denied``), or None when it can try. Not only regular files pass: a named pipe
    or ``/dev/stdin`` can be read too."""
    where = Path(path)
    if where.is_dir():
        return "it is a directory"
    if not where.exists():
        return "no such file"
    if not os.access(where, os.R_OK):
        return "permission denied"
    return None


def configure_logging(*, level: str = "info", log_format: str = "auto") -> None:
    """Configure structlog (and stdlib logging, for hypercorn) to write to stderr.

    Stderr, never stdout: stdout may carry a JSON document.

    Args:
        level: Lowest level logged: ``debug``, ``info``, ``warning`` or ``error``.
        log_format: ``json``, ``console``, or ``auto`` (console on a terminal, JSON otherwise).
    """
    if level not in LOG_LEVELS:
        msg = f"level must be one of {', '.join(LOG_LEVELS)}, got {level!r}"
        raise ValueError(msg)
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if use_json:
        processors += [JSON_TRACEBACKS, structlog.processors.JSONRenderer()]
    else:
        # Without locals: rendering the locals of every trio frame of one traceback took 11 s
        # (the event loop stalls meanwhile), against 0.08 s for the traceback alone.
        formatter = structlog.dev.RichTracebackFormatter(show_locals=False)
        processors.append(
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), exception_formatter=formatter)
        )
    numeric_level = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(
        level=max(numeric_level, logging.WARNING),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )


class WholeLines(io.TextIOBase):
    """A text stream that passes on only whole lines, each in one write under one lock.

    Two threads printing to one stream can splice their lines together: ``print`` writes the
    text and the newline in two calls, and a driver of Ray placement has Ray's log forwarding
    printing the stage processes' lines while structlog writes its own (a JSON event then
    shared a line with another, and a reader could parse neither). Here each thread's text is
    held until its newline, and every line goes out whole. :meth:`flush` passes on the calling
    thread's unfinished line too.
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream
        self._lock = threading.Lock()
        self._held = threading.local()

    def write(self, text: str) -> int:
        held: str = getattr(self._held, "text", "") + text
        lines, newline, rest = held.rpartition("\n")
        self._held.text = rest
        if newline:
            with self._lock:
                self.stream.write(lines + newline)
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        rest: str = getattr(self._held, "text", "")
        if not rest:
            return  # write() flushed every whole line it passed on
        self._held.text = ""
        with self._lock:
            self.stream.write(rest)
            self.stream.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]  # (the wrapped stream's)
        return self.stream.encoding


def whole_line_stderr() -> None:
    """Make ``sys.stderr`` a :class:`WholeLines` stream (once), where the logs go: for the
    command line's own process only, which owns its standard streams. (Not stdout: a replay
    writes its JSON document there, in pieces with no newline.)"""
    stream = sys.stderr
    if stream is not None and not isinstance(stream, WholeLines):
        sys.stderr = WholeLines(stream)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            msg = f"must be an integer >= {minimum}, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None
        if value < minimum:
            msg = f"must be an integer >= {minimum}, got {value}"
            raise argparse.ArgumentTypeError(msg)
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def ray_address(text: str) -> str:
    """An argparse type: a Ray address (``--ray-address``), which is not blank."""
    if not text.strip():
        msg = f"must be a Ray address ('auto', 'host:port' or 'ray://host:port'), got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return text


ray_address.__name__ = "Ray address"


def int_between(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[minimum, maximum]``."""
    rule = f"an integer in [{minimum:,}, {maximum:,}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            msg = f"must be {rule}, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None
        if not minimum <= value <= maximum:
            msg = f"must be {rule}, got {value}"
            raise argparse.ArgumentTypeError(msg)
        return value

    parse.__name__ = rule
    return parse


def _finite_number(text: str, rule: str) -> float:
    try:
        value = float(text)
    except ValueError:
        msg = f"must be {rule}, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not math.isfinite(value):
        msg = f"must be {rule}, got {text}"
        raise argparse.ArgumentTypeError(msg)
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number ``>= 0``."""
    rule = "a finite number >= 0"
    value = _finite_number(text, rule)
    if value < 0:
        msg = f"must be {rule}, got {text}"
        raise argparse.ArgumentTypeError(msg)
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number ``> 0``."""
    rule = "a finite number > 0"
    value = _finite_number(text, rule)
    if value <= 0:
        msg = f"must be {rule}, got {text}"
        raise argparse.ArgumentTypeError(msg)
    return value
