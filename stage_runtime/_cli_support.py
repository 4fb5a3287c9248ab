"""What the command lines share: logging setup and argument types.

``stage-runtime`` (:mod:`stage_runtime.cli`) and its ``serve`` subcommand
(:mod:`stage_runtime.server.command`) configure structlog the same way (stderr, UTC ISO
timestamps, a console renderer on a terminal and JSON lines otherwise) and word their argument
errors the same way (``must be ..., got X``). Library code never calls these.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable

import structlog

LOG_LEVELS = ("debug", "info", "warning", "error")
"""Level names accepted by :func:`configure_logging`, lowest first."""


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
        processors += [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
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
