"""The ``stage-runtime serve`` subcommand.

:func:`add_serve_arguments` declares the flags and :func:`run_serve` runs the server until
SIGINT/SIGTERM. Hypercorn is imported only when the server starts, so the CLI works (and reports
a clear error) without the ``server`` extra.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Final

import structlog
import trio

from stage_runtime._cli_support import (
    LOG_LEVELS,
    configure_logging,
    int_at_least,
    int_between,
    non_negative_float,
    positive_float,
    ray_address,
    unreadable,
)
from stage_runtime.config import unrecognised_cache_mode
from stage_runtime.errors import ConfigError
from stage_runtime.limits import MAX_REFERENCE_WIDTH

__all__ = ["add_serve_arguments", "configure_logging", "run_serve"]

SERVER_MODULES = ("hypercorn", "hypercorn.trio", "prometheus_client", "starlette")
"""What serving imports beyond the base install (the ``server`` extra)."""


_positive_int = int_at_least(1)
_non_negative_int = int_at_least(0)


MAX_WIDTH: Final = MAX_REFERENCE_WIDTH
"""Largest ``--width``: the reference model holds a ``width x width`` float64 matrix per stage
(512 MiB at 8,192); a topology's ``[model]`` table has the same bound."""

_width = int_between(1, MAX_WIDTH)

DEFAULT_WIDTH: Final = 64
"""``--width`` when not given (and the topology has no ``[model]`` table)."""

DEFAULT_SEED: Final = 0
"""``--seed`` when not given (and the topology has no ``[model]`` table)."""


def _bind(text: str) -> str:
    from stage_runtime.server.serve import _parse_bind  # one rule for the flag and serve()

    try:
        _parse_bind(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("bind ")) from None
    return text


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the ``serve`` flags on ``parser``."""
    parser.add_argument(
        "--topology",
        type=Path,
        required=True,
        metavar="FILE",
        help="pipeline topology (TOML: one [[stage]] table per stage; docs/pipelines.md shows one)",
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
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="on shutdown, how long in-flight requests may still run (default: %(default)s)",
    )
    parser.add_argument(
        "--body-timeout",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="how long a client may take to send a prefill's body; slower ones get 408 "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=positive_float,
        default=75.0,
        metavar="SECONDS",
        help="how long an idle keep-alive connection stays open; keep it longer than clients' "
        "own expiry (httpx: 5 s) so no request races the close (default: %(default)s)",
    )
    parser.add_argument(
        "--backlog",
        type=_positive_int,
        default=1024,
        metavar="N",
        help="connections queued before they are accepted (capped by net.core.somaxconn) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--drain-grace",
        type=non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="on shutdown, how long /readyz reports draining before the listener closes "
        "(default: %(default)s)",
    )
    # Both default to None, resolved in _serve: given with a topology whose [model] table
    # chooses the model, they are refused, not silently ignored.
    parser.add_argument(
        "--width",
        type=_width,
        default=None,
        metavar="N",
        help=f"activation width of the reference model, at most 8,192 (default: {DEFAULT_WIDTH}); "
        "not with a topology whose [model] table chooses the model",
    )
    parser.add_argument(
        "--seed",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="seed of the reference model's weights; stage i uses N + i "
        f"(default: {DEFAULT_SEED}); not with a topology whose [model] table chooses the model",
    )
    parser.add_argument(
        "--channel-size",
        type=_positive_int,
        default=4,
        metavar="N",
        help="frames buffered between two stages (default: %(default)s)",
    )
    parser.add_argument(
        "--placement",
        choices=("local", "ray"),
        default=None,
        help="where the stages run: this process (local) or one Ray actor process per stage "
        "(ray; needs the ray extra); default: the topology's [placement] table, else local",
    )
    parser.add_argument(
        "--ray-address",
        type=ray_address,
        default=None,
        metavar="ADDR",
        help="join the Ray cluster at ADDR ('auto', 'host:port' or 'ray://host:port'); "
        "implies --placement ray (default: start a local Ray instance)",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="lowest level logged (default: %(default)s)",
    )
    parser.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="auto: coloured console on a terminal, JSON lines otherwise (default: %(default)s)",
    )


async def _serve(args: argparse.Namespace) -> int:
    """Serve until shut down; returns the requests a forced shutdown dropped."""
    # Imported here: the pipeline pulls in numpy and the runtime, serving pulls in hypercorn.
    from stage_runtime.llama import LlamaModelFactory
    from stage_runtime.models import reference_model_factory
    from stage_runtime.pipeline import load_model, load_placement, open_pipeline
    from stage_runtime.placement import choose_placement
    from stage_runtime.server.app import ServerSettings, create_app
    from stage_runtime.server.serve import serve
    from stage_runtime.server.tokenizer import NoTokenizer, TextTokenizer, model_tokenizer

    placement = choose_placement(
        load_placement(args.topology), engine=args.placement, address=args.ray_address
    )
    settings = ServerSettings(
        max_inflight=args.max_inflight,
        max_body_bytes=args.max_body_bytes,
        retry_after_s=args.retry_after,
        shutdown_timeout_s=args.shutdown_timeout,
        body_timeout_s=args.body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        backlog=args.backlog,
    )
    # The topology's [model] table, else the reference model at --width and --seed; the
    # flags given with a [model] table would be ignored, so they are refused.
    factory = load_model(args.topology)
    if factory is None:
        factory = reference_model_factory(
            width=DEFAULT_WIDTH if args.width is None else args.width,
            seed=DEFAULT_SEED if args.seed is None else args.seed,
        )
    else:
        given = [
            flag
            for flag, value in (("--width", args.width), ("--seed", args.seed))
            if value is not None
        ]
        if given:
            flags = " and ".join(given)
            msg = (
                f"{flags} cannot be given with {args.topology}: its [model] table chooses the "
                "model (--width and --seed set the reference model of a topology without one)"
            )
            raise ConfigError(msg)
    # Given the file, not its stages, the pipeline names the file and line of a stage the
    # model refuses (a layer range that does not cover the model).
    async with open_pipeline(
        args.topology, factory, channel_size=args.channel_size, placement=placement
    ) as pipeline:
        # A Llama model directory with a tokenizer.json tokenizes the "text" field its way;
        # without one, text is refused (byte ids mean nothing to the model's vocabulary).
        tokenizer: TextTokenizer | None = None
        if isinstance(factory, LlamaModelFactory):
            tokenizer = model_tokenizer(factory.path) or NoTokenizer(
                reason="the model has none (its directory holds no tokenizer.json)"
            )
        app = create_app(pipeline, settings=settings, tokenizer=tokenizer)
        await serve(app, bind=args.bind, handle_signals=True, drain_grace_s=args.drain_grace)
    # Leaving open_pipeline after the server has drained stops the stages.
    return app.dropped


def _first_leaf(group: BaseExceptionGroup[Exception]) -> Exception:
    """The first non-group exception inside (nested) exception groups."""
    error: Exception | BaseExceptionGroup[Exception] = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def run_serve(args: argparse.Namespace) -> int:
    """Run ``stage-runtime serve`` with parsed ``args``; returns the process exit status.

    ``0`` after a graceful shutdown, ``2`` for a bad topology or option or a missing ``server``
    extra, ``1`` when the topology file cannot be read, the address cannot be bound or a forced
    shutdown dropped requests.
    """
    # Before anything starts: without the extra, fail in one line, not after the pipeline ran.
    for module in SERVER_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            print(
                f"stage-runtime serve: error: the server needs the 'server' extra "
                f"({exc.name or module} is missing): pip install 'stage-runtime[server]'",
                file=sys.stderr,
            )
            return 2
    # An unreadable file is bad input (exit code 1), as for a trace; a topology that reads
    # but says something impossible is a bad setting (exit code 2, below).
    reason = unreadable(args.topology)
    if reason is not None:
        print(
            f"stage-runtime serve: error: cannot read topology {args.topology}: {reason}",
            file=sys.stderr,
        )
        return 1
    mistyped = unrecognised_cache_mode()
    if mistyped is not None:
        # A plain line whatever the log format: the structured warning can drown in JSON logs.
        print(f"stage-runtime serve: warning: {mistyped}", file=sys.stderr)
    configure_logging(level=args.log_level, log_format=args.log_format)
    log = structlog.get_logger(__name__)
    status = 0
    dropped = 0
    # Errors raised inside the pipeline's or hypercorn's nurseries arrive in exception groups.
    try:
        dropped = trio.run(_serve, args)
    except* ConfigError as group:
        print(f"stage-runtime serve: error: {_first_leaf(group)}", file=sys.stderr)
        status = 2
    except* OSError as group:
        message = f"cannot listen on {args.bind}: {_first_leaf(group)}"
        print(f"stage-runtime serve: error: {message}", file=sys.stderr)
        status = 1
    if status == 0 and dropped:
        # A forced shutdown: tell a supervisor that requests went unanswered.
        print(
            f"stage-runtime serve: error: a forced shutdown dropped {dropped} request(s) "
            "before they were answered",
            file=sys.stderr,
        )
        status = 1
    if status == 0:
        log.info("serve_finished")
    return status
