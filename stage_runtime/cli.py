"""The ``stage-runtime`` command line: demo, replay, simulate, serve.

``stage-runtime demo`` replays the bundled trace excerpt through a 4-stage pipeline and prints
what the activation cache bought; ``replay TRACE.jsonl`` does the same for any Mooncake-format
trace; ``simulate`` builds a synthetic workload; ``serve`` runs the HTTP server (it needs
``stage-runtime[server]``).

Exit codes: 0 success; 1 bad input data (a malformed trace, an unreadable file); 2 bad usage
(unknown flag, impossible setting), always with a one-line message on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import io
import json
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, NoReturn, TextIO

from stage_runtime import limits
from stage_runtime._cli_support import (
    configure_logging,
    int_at_least,
    int_between,
    non_negative_float,
    positive_float,
    ray_address,
    unreadable,
    whole_line_stderr,
)
from stage_runtime.errors import ConfigError, TraceFormatError

if TYPE_CHECKING:
    from stage_runtime.placement import Placement
    from stage_runtime.sim import SimConfig, WorkloadSpec

__all__ = ["build_parser", "main"]

PROG = "stage-runtime"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class _UsageError(Exception):
    """A setting the parser could not check alone (exit code 2)."""


class _FileError(Exception):
    """A file the command must read or write is unusable (exit code 1)."""


class _Terminated(BaseException):
    """SIGTERM arrived while replays ran in other processes (exit code 143, as SIGTERM's own):
    raised in the main thread so that the executor's block stops them before the command
    exits. (Not an Exception: nothing on the way may take it for an error and go on.)"""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


@contextlib.contextmanager
def _terminated_cleanly(enabled: bool) -> Iterator[None]:
    """While enabled, SIGTERM raises :class:`_Terminated` instead of ending the process at
    once, which left the worker processes (or a Ray instance it started) running as orphans.
    Only around a fan-out: a one-process replay runs inside trio, where an exception raised by
    a signal handler could land in the middle of the scheduler, and has no process to leave."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        # (None: the handler was not set from Python, by an embedding program say.)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _cost_at_most(scale: float) -> Callable[[str], float]:
    """An argparse type: a cost in ``1/scale`` seconds, ``>= 0`` and at most an hour."""
    limit = limits.MAX_COST_S * scale

    def parse(text: str) -> float:
        value = non_negative_float(text)
        if value > limit:
            msg = f"must be at most {limit:g} (an hour), got {text}"
            raise argparse.ArgumentTypeError(msg)
        return value

    return parse


_us_cost = _cost_at_most(1e6)
_ns_cost = _cost_at_most(1e9)


def _costs(text: str) -> list[float]:
    try:
        return [_us_cost(part.strip()) for part in text.split(",")]
    except argparse.ArgumentTypeError as exc:
        msg = f"every cost {exc}"
        raise argparse.ArgumentTypeError(msg) from None


def _capacities(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        msg = f"must be a comma-separated list of token counts like 0,65536,262144, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    parse = int_at_least(0)
    try:
        capacities = {parse(part) for part in parts}
    except argparse.ArgumentTypeError as exc:
        msg = f"every capacity {exc}"
        raise argparse.ArgumentTypeError(msg) from None
    # Each once, in the report's order (smallest first, unbounded last), JSON included.
    return sorted(capacities, key=lambda capacity: (capacity == 0, capacity))


_POSITIVE = int_at_least(1)
_NON_NEGATIVE = int_at_least(0)
# The sim package is imported lazily, so that --help and usage errors stay fast: the limits
# come from stage_runtime.limits, as the simulator's do.
_DEMO_BLOCK_SIZE = 512
"""Tokens per hash id in the bundled excerpt (as in every Mooncake trace)."""


def _add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    pipeline = parser.add_argument_group("pipeline and cache")
    pipeline.add_argument(
        "--stages",
        type=int_between(1, limits.MAX_STAGES),
        metavar="N",
        default=4,
        help=f"pipeline stages (4; at most {limits.MAX_STAGES})",
    )
    pipeline.add_argument(
        "--block-size",
        type=int_between(limits.MIN_BLOCK_SIZE, limits.MAX_BLOCK_SIZE),
        metavar="N",
        default=512,
        help="tokens per block: per trace hash id, or per block of a synthetic prompt (512)",
    )
    pipeline.add_argument(
        "--min-tokens",
        type=_NON_NEGATIVE,
        metavar="N",
        default=None,
        help="shortest cached prefix (default: the block size)",
    )
    pipeline.add_argument(
        "--stride",
        type=_NON_NEGATIVE,
        metavar="N",
        default=None,
        help="lookup-grid stride in tokens (default: the block size)",
    )
    pipeline.add_argument(
        "--record-limit",
        type=_NON_NEGATIVE,
        metavar="N",
        default=2,
        help="prefix lengths recorded per request; 0 = every grid length (2)",
    )
    pipeline.add_argument(
        "--max-entries",
        type=int_between(1, limits.U64_MAX),
        metavar="N",
        default=None,
        help="entries per stage cache (64 with --index ladder; with --index paged every page "
        "is an entry, so the default is 1,000,000 and --capacity-tokens does the bounding)",
    )
    pipeline.add_argument(
        "--index",
        choices=["ladder", "paged"],
        default="ladder",
        help="cache index: 'ladder', the upstream's per-length entries, or 'paged', pages "
        "shared across prompts (default: ladder)",
    )
    pipeline.add_argument(
        "--page-tokens",
        type=int_between(1, limits.U64_MAX),
        metavar="N",
        default=None,
        help="tokens per page with --index paged (default: the stride)",
    )
    pipeline.add_argument(
        "--page-eviction",
        choices=["lru", "reuse", "adaptive"],
        default=None,
        help="with --index paged: 'lru' evicts the least recently used page, 'reuse' the "
        "least valuable by reuse and recompute saved, 'adaptive' keeps the pages of the "
        "kinds of prompt it has seen come back (default: lru)",
    )
    pipeline.add_argument(
        "--capacity-tokens",
        type=_NON_NEGATIVE,
        metavar="N",
        default=None,
        help="per-stage cache capacity in tokens: max_bytes = capacity x bytes per token; "
        "0 = unbounded (0)",
    )
    pipeline.add_argument(
        "--bytes-per-token",
        type=int_between(1, limits.MAX_BYTES_PER_TOKEN),
        metavar="N",
        default=8192,
        help="activation bytes per token (8192: 4096-wide bf16)",
    )
    pipeline.add_argument(
        "--sweep-capacity",
        type=_capacities,
        default=None,
        metavar="A,B,C",
        help="replay once per capacity (tokens; 0 = unbounded) and report them side by side",
    )

    run = parser.add_argument_group("replay")
    run.add_argument(
        "--concurrency",
        type=_POSITIVE,
        metavar="N",
        default=1,
        help="requests in flight; 1 = file order, one at a time; more = arrivals by timestamp (1)",
    )
    run.add_argument(
        "--limit-requests",
        type=_POSITIVE,
        metavar="N",
        default=None,
        help="replay only the first N requests (default: all)",
    )
    run.add_argument(
        "--prefill-us-per-token",
        type=_costs,
        default=[25.0],
        metavar="US[,US...]",
        help="simulated compute per token per stage, microseconds; one value for every stage "
        "or one per stage (25)",
    )
    run.add_argument(
        "--restore-ns-per-byte",
        type=_ns_cost,
        default=0.05,
        metavar="NS",
        help="simulated restore cost per cached byte, nanoseconds (0.05, i.e. 20 GB/s)",
    )

    processes = parser.add_argument_group("processes")
    processes.add_argument(
        "--workers",
        type=_POSITIVE,
        metavar="N",
        default=None,
        help="replay each stage (and each capacity of a sweep) in N local processes at once; "
        "the results are identical, the wall time shorter (1: this process only; with "
        "--placement ray: the most at once on Ray)",
    )
    processes.add_argument(
        "--placement",
        choices=["local", "ray"],
        default=None,
        help="where the stages replay: 'local' (this process, or --workers processes) or 'ray' "
        "(Ray tasks; needs stage-runtime[ray]) (default: local)",
    )
    processes.add_argument(
        "--ray-address",
        metavar="ADDR",
        type=ray_address,
        default=None,
        help="the Ray cluster to join ('auto', 'host:port' or 'ray://host:port'); implies "
        "--placement ray (default: start a local Ray instance)",
    )

    output = parser.add_argument_group("output")
    output.add_argument(
        "--json", metavar="PATH", default=None, help="write the results as JSON ('-': stdout only)"
    )
    output.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help="write a PNG plot, or SVG/PDF by the suffix (needs stage-runtime[plot])",
    )
    output.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log to stderr: -v lifecycle and evictions (info), -vv also every restore, miss "
        "and record (debug; very verbose); warnings only without it",
    )


def _add_serve(subcommands: argparse._SubParsersAction[_Parser]) -> None:
    help_text = "run the HTTP server (needs stage-runtime[server])"
    try:
        from stage_runtime.server import command  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        serve = subcommands.add_parser(
            "serve", help=help_text, description=help_text, allow_abbrev=False
        )
        serve.set_defaults(run=_serve_unavailable, parser=serve)
        return
    serve = subcommands.add_parser(
        "serve", help=help_text, description=help_text, allow_abbrev=False
    )
    command.add_serve_arguments(serve)
    serve.set_defaults(run=_run_serve, parser=serve)


def _serve_unavailable(args: argparse.Namespace) -> int:
    print(
        f"{PROG} serve: error: the server is not part of this installation "
        "(stage_runtime.server is missing)",
        file=sys.stderr,
    )
    return 2


def _run_serve(args: argparse.Namespace) -> int:
    # run_serve checks for the server extra itself, before starting anything.
    from stage_runtime.server import command  # type: ignore[import-not-found, unused-ignore]

    return int(command.run_serve(args))


def build_parser() -> argparse.ArgumentParser:
    """The ``stage-runtime`` argument parser (subcommands demo, replay, simulate, serve)."""
    parser = _Parser(
        prog=PROG,
        allow_abbrev=False,
        description="Pipeline-parallel LLM inference on trio with per-stage activation caches: "
        "replay request traces through a simulated pipeline and see what the cache buys.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = subcommands.add_parser(
        "demo",
        allow_abbrev=False,
        help="replay the bundled 300-request trace excerpt through 4 stages",
        description="Replay the bundled excerpt of the Mooncake synthetic trace (300 requests, "
        "Apache-2.0) through a simulated 4-stage pipeline and report what the cache bought.",
    )
    _add_simulation_arguments(demo)
    demo.set_defaults(run=_run_simulation, parser=demo)

    replay = subcommands.add_parser(
        "replay",
        allow_abbrev=False,
        help="replay a Mooncake-format trace (.jsonl)",
        description="Replay a Mooncake-format request trace through a simulated pipeline.",
    )
    replay.add_argument(
        "trace", metavar="TRACE.jsonl", help="the trace file ('-': standard input, or a pipe)"
    )
    replay.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip malformed lines (counted in the report) instead of stopping at the first",
    )
    _add_simulation_arguments(replay)
    replay.set_defaults(run=_run_simulation, parser=replay)

    simulate = subcommands.add_parser(
        "simulate",
        allow_abbrev=False,
        help="replay a synthetic workload (shared system prompts, conversations)",
        description="Replay a synthetic workload: groups of prompts sharing a system prompt, "
        "and multi-turn conversations, arriving as a seeded Poisson process.",
    )
    workload = simulate.add_argument_group("workload")
    workload.add_argument(
        "--groups", type=_NON_NEGATIVE, metavar="N", default=8, help="prompt groups (8)"
    )
    workload.add_argument(
        "--prompts-per-group",
        type=_POSITIVE,
        metavar="N",
        default=12,
        help="prompts per group (12)",
    )
    workload.add_argument(
        "--system-prompt-tokens",
        type=_NON_NEGATIVE,
        metavar="N",
        default=3072,
        help="system prompt shared by a group (3072)",
    )
    workload.add_argument(
        "--question-tokens",
        type=_POSITIVE,
        metavar="N",
        default=384,
        help="question after it (384)",
    )
    workload.add_argument(
        "--conversations",
        type=_NON_NEGATIVE,
        metavar="N",
        default=8,
        help="multi-turn conversations (8)",
    )
    workload.add_argument(
        "--turns", type=_POSITIVE, metavar="N", default=6, help="turns per conversation (6)"
    )
    workload.add_argument(
        "--tokens-per-turn",
        type=_POSITIVE,
        metavar="N",
        default=512,
        help="tokens each turn adds (512)",
    )
    workload.add_argument(
        "--rate",
        type=positive_float,
        default=4.0,
        metavar="PER_S",
        help="mean arrivals per second; sets the timestamps, which only --concurrency above 1 "
        "follows (4)",
    )
    workload.add_argument(
        "--seed", type=_NON_NEGATIVE, default=0, metavar="N", help="seed of order and arrivals (0)"
    )
    _add_simulation_arguments(simulate)
    simulate.set_defaults(run=_run_simulation, parser=simulate)

    _add_serve(subcommands)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("stage-runtime")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "unknown"


_VERBOSITY = ("warning", "info", "debug")
"""Log level by number of ``-v``."""


def _check_output(path: str | None, what: str) -> None:
    """Refuse an output path that cannot be written, before any replay work is done."""
    if path is None or path == "-":
        return
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        msg = f"cannot write {what} to {path}: it is a directory"
        raise _FileError(msg)
    if not folder.is_dir():
        msg = f"cannot write {what} to {path}: directory {folder} does not exist"
        raise _FileError(msg)
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        reason = "read-only file system" if _read_only(folder) else "permission denied"
        msg = f"cannot write {what} to {path}: {reason}"
        raise _FileError(msg)


def _read_only(folder: Path) -> bool:
    """Whether ``folder`` is on a read-only mount (where chmod cannot help)."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _check_files(args: argparse.Namespace) -> None:
    """Check the trace to read and the outputs to write before replaying anything."""
    trace: str | None = getattr(args, "trace", None)
    if trace is not None and trace != "-":
        # Not only regular files: a named pipe or /dev/stdin streams a trace too.
        reason = unreadable(trace)
        if reason is not None:
            msg = f"cannot read trace {trace}: {reason}"
            raise _FileError(msg)
        for flag, output in (("--json", args.json), ("--plot", args.plot)):
            if output not in (None, "-") and _same_file(trace, output):
                msg = f"{flag} names the trace being replayed ({output}): it would replace it"
                raise _UsageError(msg)
    if args.plot == "-":  # (--json - is stdout; a plot there would be binary on a terminal)
        msg = "--plot takes a file (.png, .svg or .pdf), not - (stdout)"
        raise _UsageError(msg)
    _check_output(args.json, "JSON")
    _check_output(args.plot, "plot")
    if args.plot is not None:
        from stage_runtime.sim.report import plot_format

        plot_format(args.plot)  # a suffix matplotlib would refuse only after the replay


def _same_file(first: str, second: str) -> bool:
    """Whether two paths name one file (through links too, where the second exists)."""
    try:
        return os.path.samefile(first, second)
    except OSError:  # the output does not exist yet (or cannot be looked at)
        return os.path.realpath(first) == os.path.realpath(second)


def _check_usage(args: argparse.Namespace) -> None:
    """Refuse settings that are valid one by one but impossible together."""
    if args.sweep_capacity is not None and args.capacity_tokens is not None:
        msg = "--capacity-tokens and --sweep-capacity are exclusive; use one"
        raise _UsageError(msg)
    for capacity in args.sweep_capacity or [args.capacity_tokens or 0]:
        if capacity * args.bytes_per_token > limits.MAX_CACHE_BYTES:
            flag = "--sweep-capacity" if args.sweep_capacity else "--capacity-tokens"
            msg = (
                f"{flag} {capacity:,} x --bytes-per-token {args.bytes_per_token:,} is "
                f"{capacity * args.bytes_per_token:,} bytes, more than a cache's byte bound "
                f"allows ({limits.MAX_CACHE_BYTES:,})"
            )
            raise _UsageError(msg)
    stride = args.block_size if args.stride is None else args.stride
    if stride == 0 and args.record_limit > 0:
        msg = (
            f"--stride 0 leaves no lookup grid for --record-limit {args.record_limit}; "
            "use --stride >= 1 or --record-limit 0"
        )
        raise _UsageError(msg)
    if args.index == "ladder":
        paged_only = [
            flag
            for flag, value in (
                ("--page-tokens", args.page_tokens),
                ("--page-eviction", args.page_eviction),
            )
            if value is not None
        ]
        if paged_only:
            verb = "apply" if len(paged_only) > 1 else "applies"
            msg = f"{' and '.join(paged_only)} {verb} to --index paged only (got --index ladder)"
            raise _UsageError(msg)
    costs = len(args.prefill_us_per_token)
    if costs > 1 and costs != args.stages:
        msg = f"--prefill-us-per-token needs one cost or one per stage ({args.stages}), got {costs}"
        raise _UsageError(msg)
    if args.plot is not None:
        try:  # now, not after a replay that may take minutes
            with warnings.catch_warnings():  # a warning on import (under -W error) is not
                warnings.simplefilter("ignore")  # "cannot be imported"
                import matplotlib  # noqa: F401
        except Exception as exc:  # missing, or broken (any import error)
            msg = (
                f"--plot needs matplotlib ({type(exc).__name__}: {exc}); install it with: "
                "pip install 'stage-runtime[plot]'"
            )
            raise _UsageError(msg) from exc
        if args.json not in (None, "-") and _same_file(args.json, args.plot):
            msg = f"--json and --plot name the same file ({args.plot}): the plot would replace it"
            raise _UsageError(msg)
    _placement(args)  # refuses --ray-address with --placement local, or Ray not installed
    if args.command == "simulate" and args.groups == 0 and args.conversations == 0:
        msg = "--groups and --conversations are both 0: the workload has no requests"
        raise _UsageError(msg)
    if args.command == "simulate":
        _check_prompt_lengths(args)
    if args.command == "demo" and args.block_size < _DEMO_BLOCK_SIZE:
        # Every line of the excerpt would be refused, the first one named as if it were bad.
        msg = (
            f"--block-size {args.block_size} is smaller than the bundled excerpt's "
            f"{_DEMO_BLOCK_SIZE}-token blocks; the demo needs --block-size >= {_DEMO_BLOCK_SIZE}"
        )
        raise _UsageError(msg)


def _placement(args: argparse.Namespace) -> Placement | None:
    """Where ``--placement`` and ``--ray-address`` put the stages (None: this host's processes).

    Raises:
        _UsageError: ``--ray-address`` with ``--placement local``.
        ConfigError: Ray is asked for but not installed (the message names the extra).
    """
    if args.placement == "local" and args.ray_address is not None:
        msg = f"--ray-address {args.ray_address} needs --placement ray, got --placement local"
        raise _UsageError(msg)
    if args.placement != "ray" and args.ray_address is None:
        return None
    from stage_runtime.placement import choose_placement

    return choose_placement(None, engine="ray", address=args.ray_address)


def _check_prompt_lengths(args: argparse.Namespace) -> None:
    """Refuse synthetic prompts longer than the simulated stages' context."""
    if args.groups and args.system_prompt_tokens + args.question_tokens > limits.SIM_CTX_SIZE:
        msg = (
            f"--system-prompt-tokens {args.system_prompt_tokens:,} + --question-tokens "
            f"{args.question_tokens:,} make prompts longer than the stages' context "
            f"({limits.SIM_CTX_SIZE:,} tokens)"
        )
        raise _UsageError(msg)
    if args.conversations and args.turns * args.tokens_per_turn > limits.SIM_CTX_SIZE:
        msg = (
            f"--turns {args.turns:,} x --tokens-per-turn {args.tokens_per_turn:,} make the last "
            f"turn longer than the stages' context ({limits.SIM_CTX_SIZE:,} tokens)"
        )
        raise _UsageError(msg)


def _sim_config(args: argparse.Namespace) -> SimConfig:
    from stage_runtime.sim import CostModel, SimConfig

    # Unset, --max-entries is SimConfig's default for the index (64, or 1,000,000 pages).
    entries = {} if args.max_entries is None else {"max_entries": args.max_entries}
    return SimConfig(
        **entries,
        stages=args.stages,
        block_size=args.block_size,
        min_tokens=args.min_tokens,
        stride_tokens=args.stride,
        record_limit=args.record_limit,
        index=args.index,
        page_tokens=args.page_tokens,
        page_eviction=args.page_eviction or "lru",
        capacity_tokens=args.capacity_tokens or 0,
        bytes_per_token=args.bytes_per_token,
        concurrency=args.concurrency,
        cost=CostModel(
            prefill_s_per_token=args.prefill_us_per_token[0] / 1e6,
            stage_prefill_s_per_token=(
                [us / 1e6 for us in args.prefill_us_per_token]
                if len(args.prefill_us_per_token) > 1
                else []
            ),
            restore_s_per_byte=args.restore_ns_per_byte / 1e9,
        ),
    )


def _run_simulation(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from stage_runtime import sim

    if isinstance(sys.stdout, io.TextIOWrapper):
        # An ASCII-only stdout (PYTHONIOENCODING=ascii, a C locale without UTF-8 coercion)
        # would raise on a path or a quoted line with other characters after the whole replay;
        # escape them as stderr does.
        sys.stdout.reconfigure(errors="backslashreplace")

    config = _sim_config(args)
    source: dict[str, object]
    skipped = 0
    first_error: str | None = None
    if args.command == "simulate":
        spec = sim.WorkloadSpec(
            groups=args.groups,
            prompts_per_group=args.prompts_per_group,
            system_prompt_tokens=args.system_prompt_tokens,
            question_tokens=args.question_tokens,
            conversations=args.conversations,
            turns=args.turns,
            tokens_per_turn=args.tokens_per_turn,
            requests_per_s=args.rate,
            seed=args.seed,
        )
        requests = sim.synthetic_workload(spec, block_size=config.block_size)
        if args.limit_requests is not None:
            requests = requests[: args.limit_requests]
        source = {"kind": "synthetic", "limit_requests": args.limit_requests, **_spec_dict(spec)}
        title = f"{PROG} simulate: {len(requests):,} synthetic requests"
    else:
        if args.command == "demo":
            trace = sim.read_demo_trace(block_size=config.block_size, limit=args.limit_requests)
        else:
            try:
                if args.trace == "-":
                    if sys.stdin is None:  # started with stdin closed (<&-)
                        msg = "cannot read trace -: standard input is closed"
                        raise _FileError(msg)
                    trace = sim.read_trace_lines(
                        sim.trace_file_lines(sys.stdin.buffer, path="<stdin>"),
                        path="<stdin>",
                        block_size=config.block_size,
                        skip_bad_lines=args.skip_bad_lines,
                        limit=args.limit_requests,
                        max_input_length=config.ctx_size,
                    )
                else:
                    trace = sim.read_trace(
                        args.trace,
                        block_size=config.block_size,
                        skip_bad_lines=args.skip_bad_lines,
                        limit=args.limit_requests,
                        max_input_length=config.ctx_size,
                    )
            except OSError as exc:
                msg = f"cannot read trace {args.trace}: {exc.strerror or exc}"
                raise _FileError(msg) from exc
        requests = list(trace.requests)
        skipped = trace.skipped_lines
        first_error = trace.first_error
        source = {
            "kind": "trace",
            "path": trace.path,
            "limit_requests": args.limit_requests,
            "skip_bad_lines": bool(getattr(args, "skip_bad_lines", False)),
            "skipped_lines": skipped,
        }
        title = f"{PROG} {args.command}: {trace.path}"
    if not requests:
        where = source.get("path", "the workload")
        if skipped:
            reason = f"every line was bad ({skipped:,} skipped; the first: {first_error})"
        else:
            reason = "it has no request lines (empty or blank)"
        print(
            f"{PROG} {args.command}: error: no requests to replay in {where}: {reason}",
            file=sys.stderr,
        )
        return 1

    json_to_stdout = args.json == "-"
    console = Console(stderr=json_to_stdout)
    if not console.is_terminal:
        # Piped or redirected: rich would assume 80 columns and squeeze the tables.
        console = Console(stderr=json_to_stdout, width=120)
    status = Console(stderr=True)
    capacities: list[int] | None = args.sweep_capacity
    runs = len(capacities) if capacities else 1
    placement = _placement(args)
    on_ray = placement is not None
    # No more processes than units (one per stage and capacity): the others would idle.
    workers = 1 if on_ray else min(args.workers or 1, config.stages * runs)
    # Off with -v: log lines written under a live bar end up glued to it.
    show_progress = status.is_terminal and not json_to_stdout and not args.verbose
    with (
        _terminated_cleanly(workers > 1 or on_ray),
        sim.open_executor(workers=workers, placement=placement) as executor,
        Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=status,
            transient=True,
            disable=not show_progress,
        ) as progress,
    ):
        where = "on Ray" if on_ray else f"in {workers} processes"
        label = "replaying" if executor is None else f"replaying {where}"
        task = progress.add_task(label, total=len(requests) * runs)

        def advance(done: int) -> None:
            if capacities and executor is None:  # say which replay of the sweep this is
                run_index = min(done // max(len(requests), 1), runs - 1)
                capacity = capacities[run_index]
                shown = f"{capacity:,} tokens" if capacity else "unbounded"
                description = f"capacity {shown} ({run_index + 1}/{runs})"
                progress.update(task, completed=done, description=description)
            else:
                progress.update(task, completed=done)

        if executor is not None:  # the capacities replay side by side
            results = sim.fan_out(
                requests,
                config,
                capacities or [config.capacity_tokens],
                executor,
                progress=advance,
                max_in_flight=args.workers if on_ray else None,
                # The units log as this process does (-v), on their own stderr.
                log_setup=functools.partial(
                    configure_logging, level=_VERBOSITY[min(args.verbose, 2)]
                ),
            )
        elif capacities:
            results = sim.run_sweep(requests, config, capacities, progress=advance)
        else:
            results = [sim.run_replay(requests, config, progress=advance)]

    documents = [sim.result_to_json(result, source=source) for result in results]
    for document in documents:
        document["skipped_lines"] = skipped
    payload: object = documents if capacities else documents[0]
    if not json_to_stdout:
        try:
            if capacities:
                sim.render_sweep(console, results, title=title)
            else:
                sim.render_report(console, results[0], title=title, skipped_lines=skipped)
            if skipped:
                console.print(Text(f"skipped {skipped:,} bad line(s); the first: {first_error}"))
        except OSError as exc:  # (a full disk, say; a closed pipe is rich's: exit 1, silent)
            msg = f"cannot write the report to stdout: {exc.strerror or exc}"
            raise _FileError(msg) from exc
    if args.json is not None:
        try:
            _write_json(payload, args.json, sys.stdout)
        except OSError as exc:
            msg = f"cannot write JSON to {args.json}: {exc.strerror or exc}"
            raise _FileError(msg) from exc
    if args.plot is not None:
        try:
            sim.write_plot(results, args.plot)
        except OSError as exc:
            msg = f"cannot write plot to {args.plot}: {exc.strerror or exc}"
            raise _FileError(msg) from exc
        if not json_to_stdout:
            console.print(Text(f"plot written to {args.plot}"))
    return 0


def _spec_dict(spec: WorkloadSpec) -> dict[str, object]:
    import attrs

    return attrs.asdict(spec)


def _write_json(payload: object, target: str, stdout: TextIO) -> None:
    text = json.dumps(payload, indent=2) + "\n"
    if target == "-":
        stdout.write(text)
        stdout.flush()
        return
    with open(target, "w", encoding="utf-8") as handle:
        handle.write(text)


def console_main() -> int:
    """The ``stage-runtime`` and ``python -m stage_runtime`` entry point: :func:`main` in a
    process whose stderr passes on whole lines only (threads writing at once, as a Ray
    driver's log forwarding and structlog do, never splice two log lines into one)."""
    whole_line_stderr()
    return main()


_LIST_OPTIONS: Final = ("--sweep-capacity", "--prefill-us-per-token")
"""Options whose value is a comma-separated list of numbers."""


def _lists_joined(argv: Sequence[str]) -> list[str]:
    """``argv`` with each list option joined to a value starting with a minus sign
    (``--sweep-capacity -1,5`` -> ``--sweep-capacity=-1,5``): argparse passes a lone negative
    number on as a value, but takes ``-1,5`` for an unknown option and reports "expected one
    argument"; joined, the list's own check names the value that is wrong."""
    joined: list[str] = []
    for position, arg in enumerate(argv):
        if arg == "--":  # the rest are positional arguments, whatever they look like
            return [*joined, *argv[position:]]
        if joined and joined[-1] in _LIST_OPTIONS and arg[:1] == "-" and arg[1:2].isdigit():
            joined[-1] = f"{joined[-1]}={arg}"
        else:
            joined.append(arg)
    return joined


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: The arguments (without the program name); ``sys.argv[1:]`` when None.

    Returns:
        The exit code: 0 success, 1 bad input data, 2 bad usage.
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(_lists_joined(sys.argv[1:] if argv is None else argv))
    if unknown and args.run is not _serve_unavailable:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # names the command
    prefix = f"{PROG} {args.command}: error:"
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        if run is _run_simulation:
            _check_usage(args)
            _check_files(args)
            configure_logging(level=_VERBOSITY[min(args.verbose, 2)])
        return run(args)
    except (_UsageError, ConfigError) as exc:
        print(f"{prefix} {exc}", file=sys.stderr)
        return 2
    except (TraceFormatError, _FileError) as exc:
        print(f"{prefix} {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # one not anticipated above: still one line, exit code 1
        print(f"{prefix} {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prefix} interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"{prefix} terminated", file=sys.stderr)
        return 143
    except BaseExceptionGroup as group:
        # Ctrl-C during a replay reaches us wrapped by trio's nurseries.
        interrupt, rest = group.split(KeyboardInterrupt)
        if interrupt is None or rest is not None:
            raise
        print(f"{prefix} interrupted", file=sys.stderr)
        return 130
