"""The ``stage-runtime serve`` subcommand.

:func:`add_serve_arguments` declares the flags and :func:`run_serve` runs the server until
SIGINT/SIGTERM. Hypercorn is imported only when the server starts, so the CLI works (and reports
a clear error) without the ``server`` extra.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import structlog
import trio

from stage_runtime.errors import ConfigError

__all__ = ["add_serve_arguments", "configure_logging", "run_serve"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        msg = f"must be an integer, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if value < 1:
        msg = f"must be >= 1, got {value}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        msg = f"must be a number, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not value >= 0:  # also rejects nan
        msg = f"must be >= 0, got {text}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        msg = f"must be > 0, got {text}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _bind(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        msg = f"must be HOST:PORT with PORT in 0..65535, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return text


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the ``serve`` flags on ``parser``."""
    parser.add_argument(
        "--topology",
        type=Path,
        required=True,
        metavar="FILE",
        help="pipeline topology (TOML, one [[stage]] table per stage; see examples/topology.toml)",
    )
    parser.add_argument(
        "--bind",
        type=_bind,
        default="127.0.0.1:8000",
        metavar="HOST:PORT",
        help="address to listen on; port 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--max-inflight",
        type=_positive_int,
        default=64,
        metavar="N",
        help="prefills admitted at once; more get 503 + Retry-After (default: %(default)s)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=1 << 20,
        metavar="N",
        help="largest accepted request body; larger ones get 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--retry-after",
        type=_positive_int,
        default=1,
        metavar="SECONDS",
        help="Retry-After sent with 503 answers (default: %(default)s)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="on shutdown, how long in-flight requests may still run (default: %(default)s)",
    )
    parser.add_argument(
        "--drain-grace",
        type=_non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="on shutdown, how long /readyz reports draining before the listener closes "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--width",
        type=_positive_int,
        default=64,
        metavar="N",
        help="activation width of the reference model (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the reference model's weights (default: %(default)s)",
    )
    parser.add_argument(
        "--channel-size",
        type=_positive_int,
        default=4,
        metavar="N",
        help="frames buffered between two stages (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="lowest level logged (default: %(default)s)",
    )
    parser.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="auto: coloured console on a terminal, JSON lines otherwise (default: %(default)s)",
    )


def configure_logging(*, level: str = "info", log_format: str = "auto") -> None:
    """Configure structlog (and stdlib logging, for hypercorn) for a server process.

    Args:
        level: Lowest level logged: ``debug``, ``info``, ``warning`` or ``error``.
        log_format: ``json``, ``console``, or ``auto`` (console on a terminal, JSON otherwise).
    """
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if use_json:
        processors.append(structlog.processors.dict_tracebacks)
    processors.append(renderer)
    numeric_level = logging.getLevelName(level.upper())
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


async def _serve(args: argparse.Namespace) -> None:
    # Imported here: the pipeline pulls in numpy and the runtime, serving pulls in hypercorn.
    from stage_runtime.models import reference_model_factory
    from stage_runtime.pipeline import load_topology, open_pipeline
    from stage_runtime.server.app import ServerSettings, create_app
    from stage_runtime.server.serve import serve

    stages = load_topology(args.topology)
    settings = ServerSettings(
        max_inflight=args.max_inflight,
        max_body_bytes=args.max_body_bytes,
        retry_after_s=args.retry_after,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    factory = reference_model_factory(width=args.width, seed=args.seed)
    async with open_pipeline(stages, factory, channel_size=args.channel_size) as pipeline:
        app = create_app(pipeline, settings=settings)
        await serve(app, bind=args.bind, handle_signals=True, drain_grace_s=args.drain_grace)
    # Leaving open_pipeline after the server has drained stops the stages.


def _first_leaf(group: BaseExceptionGroup[Exception]) -> Exception:
    """The first non-group exception inside (nested) exception groups."""
    error: Exception | BaseExceptionGroup[Exception] = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def run_serve(args: argparse.Namespace) -> int:
    """Run ``stage-runtime serve`` with parsed ``args``; returns the process exit status.

    ``0`` after a graceful shutdown, ``2`` for a bad topology or option, ``1`` when the address
    cannot be bound.
    """
    configure_logging(level=args.log_level, log_format=args.log_format)
    log = structlog.get_logger(__name__)
    status = 0
    # Errors raised inside the pipeline's or hypercorn's nurseries arrive in exception groups.
    try:
        trio.run(_serve, args)
    except* ConfigError as group:
        print(f"stage-runtime serve: error: {_first_leaf(group)}", file=sys.stderr)
        status = 2
    except* OSError as group:
        message = f"cannot listen on {args.bind}: {_first_leaf(group)}"
        print(f"stage-runtime serve: error: {message}", file=sys.stderr)
        status = 1
    if status == 0:
        log.info("serve_finished")
    return status
