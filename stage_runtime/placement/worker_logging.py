"""Logging in the processes a driver starts (stage processes, fanned-out replay units).

The library configures no logging in the caller's process; a process it starts has nobody else
to do it, so by default it writes structlog JSON lines to stderr at the driver's level (Ray
forwards a worker's stderr to the driver). Ray-free, so that local worker processes use it too.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Final

import structlog

__all__ = ["JSON_TRACEBACKS", "driver_log_level", "one_word_json", "stderr_json_logging"]

JSON_TRACEBACKS: Final = structlog.processors.ExceptionRenderer(
    structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
)
"""An event's exception as a structured traceback without each frame's local variables
(structlog's ``dict_tracebacks`` has them): through trio and the pipeline they made one failed
request's log line 0.4 to 1.4 MB, the whole pipeline's repr and the request's fields in it."""


def driver_log_level() -> int:
    """The level structlog filters at in this process (INFO when it cannot tell)."""
    level = getattr(structlog.get_logger().bind(), "get_effective_level", None)
    if callable(level):
        value = level()
        if isinstance(value, int):
            return value
    return logging.INFO


def one_word_json(value: Any, **options: Any) -> str:
    """``json.dumps`` of ``value`` without a literal space: compact separators, and spaces in
    strings written ``\\u0020`` (the same JSON once parsed). Ray forwards worker lines to the
    driver and merges those from different processes that are equal once the words holding
    digits are dropped (``stage-0`` and ``stage-1`` alike), showing one of them with "repeated
    Nx across cluster": one word holding a timestamp is never merged, so every stage's event
    reaches the driver."""
    return json.dumps(value, separators=(",", ":"), **options).replace(" ", "\\u0020")


def stderr_json_logging(level: int, *, driver_pid: int | None = None) -> None:
    """Configure structlog JSON lines on stderr at ``level`` (events keep their contextvars,
    such as ``stage``), unless this is the driver's own process (``driver_pid``): a unit run
    there (a thread pool) keeps the driver's logging."""
    if driver_pid is not None and os.getpid() == driver_pid:
        return
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            JSON_TRACEBACKS,
            structlog.processors.JSONRenderer(serializer=one_word_json),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
