"""Stages in other processes: what placing them there buys, side by side with one process.

Each section measures one thing in one run, repeated (medians quoted) and interleaved, so that
noise from other work on the machine spreads over both sides of every ratio:

- ``replay``: ``stage-runtime replay TRACE --index paged --stages 4 --sweep-capacity
  1000000,3000000,10000000,0`` with ``--workers 2`` against one process: the wall time of each
  (the same library calls the command makes, from the worker pool's start to its shutdown;
  reading the trace is not timed), their ratio (goal: at most 0.6 on 2 cores) and whether every
  result is identical (all of the JSON but ``wall_s`` and ``tokens_per_s``, and every request's
  restores and times).

Sections are functions in :data:`SECTIONS` that return a table's rows and their goals;
``--sections`` picks some (all by default).

Usage::

    python benchmarks/bench_placement.py ../shared/traces/synthetic_trace.jsonl
    python benchmarks/bench_placement.py --trace TRACE.jsonl --sections replay --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import structlog

from stage_runtime._cli_support import int_at_least
from stage_runtime.sim import (
    ReplayResult,
    SimConfig,
    SimRequest,
    fan_out,
    open_executor,
    read_trace,
    result_to_json,
    run_sweep,
)

TAKES_TRACE = True
"""``benchmarks/run.py`` passes ``--trace PATH`` to benchmarks that set this."""

NAME = "placement"

REPLAY_CAPACITIES = (1_000_000, 3_000_000, 10_000_000, 0)
"""The issue's sweep: tokens per stage, 0 unbounded."""

REPLAY_GOAL_RATIO = 0.6
"""The issue's goal: ``--workers 2`` takes at most this share of one process's wall time."""

Rows = list[dict[str, Any]]
Section = Callable[[argparse.Namespace], dict[str, Any]]
"""A section: from the parsed arguments to ``{"rows": [...], "goals": [...], ...}`` (goals as
``benchmarks/run.py`` reads them: ``name``, ``target``, ``measured``, ``met``)."""


def _machine() -> dict[str, object]:
    versions = {name: version(name) for name in ("numpy", "trio", "blake3", "attrs", "structlog")}
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        **versions,
    }


def _capacities(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or any(value < 0 for value in values):
        msg = f"must be a comma-separated list of integers >= 0, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return values


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished (and waited-for) children, such as pool workers."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _comparable(results: Sequence[ReplayResult]) -> list[Any]:
    """All a sweep reports but real time: the JSON without wall_s and tokens_per_s, and every
    request's restored tokens and times."""
    documents = []
    for result in results:
        document = result_to_json(result)
        del document["wall_s"], document["tokens_per_s"]
        documents.append((document, result.outcomes))
    return documents


def replay_section(args: argparse.Namespace) -> dict[str, Any]:
    """The paged-index sweep of the trace through 4 stages, ``--workers`` processes against
    one; every repetition runs both, one after the other."""
    requests: list[SimRequest] = list(
        read_trace(args.trace, limit=args.limit_requests).requests  # checked by main
    )
    config = SimConfig(stages=args.stages, index="paged")
    capacities = list(args.capacities)
    walls: dict[str, list[float]] = {"one process": [], f"--workers {args.workers}": []}
    cpus: dict[str, list[float]] = {name: [] for name in walls}
    expected: list[Any] | None = None
    identical = True
    one, fanned = walls
    for _ in range(args.repeat):
        cpu, started = time.process_time(), time.perf_counter()
        results = run_sweep(requests, config, capacities)
        walls[one].append(time.perf_counter() - started)
        cpus[one].append(time.process_time() - cpu)
        comparable = _comparable(results)
        expected = comparable if expected is None else expected
        identical = identical and comparable == expected

        cpu, children, started = time.process_time(), _children_cpu_s(), time.perf_counter()
        # What the command line does: the pool starts, the units run, the pool shuts down.
        with open_executor(workers=args.workers) as executor:
            assert executor is not None
            results = fan_out(requests, config, capacities, executor)
        walls[fanned].append(time.perf_counter() - started)
        cpus[fanned].append(time.process_time() - cpu + _children_cpu_s() - children)
        identical = identical and _comparable(results) == expected

    base = statistics.median(walls[one])
    rows: Rows = [
        {
            "run": name,
            "wall_s": statistics.median(values),
            "cpu_s": statistics.median(cpus[name]),
            "wall_over_one_process": statistics.median(values) / base if base else None,
            "wall_s_all": values,
            "cpu_s_all": cpus[name],
        }
        for name, values in walls.items()
    ]
    ratio = rows[1]["wall_over_one_process"]
    return {
        "title": (
            f"replay sweep of {args.trace}: {len(requests):,} requests, "
            f"{sum(r.input_length for r in requests):,} prompt tokens, {config.stages} stages, "
            f"paged index, capacities {','.join(map(str, capacities))}; median of {args.repeat}"
        ),
        "rows": rows,
        "requests": len(requests),
        "capacities": capacities,
        "workers": args.workers,
        "config": config.as_dict(),
        "identical_results": identical,
        "notes": [f"identical results: {'yes' if identical else 'NO'}"],
        "goals": [
            {
                "name": f"replay sweep wall time, --workers {args.workers} / one process",
                "target": f"<= {REPLAY_GOAL_RATIO:g}",
                "measured": None if ratio is None else round(ratio, 3),
                "met": ratio is not None and ratio <= REPLAY_GOAL_RATIO,
            },
            {
                "name": "replay sweep results identical to one process",
                "target": "every key but wall_s and tokens_per_s, every request",
                "measured": identical,
                "met": identical,
            },
        ],
    }


SECTIONS: dict[str, Section] = {"replay": replay_section}
"""Every section, in the order they run."""

NEEDS_TRACE = frozenset({"replay"})
"""Sections that replay the trace."""


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def print_table(title: str, rows: Rows) -> None:
    """Print ``rows`` as a table of their scalar columns (lists stay in the JSON)."""
    print(title)
    if not rows:
        return
    columns = [key for key, value in rows[0].items() if not isinstance(value, list | dict)]
    cells = [[_cell(row.get(key)) for key in columns] for row in rows]
    widths = [max(len(key), *(len(line[i]) for line in cells)) for i, key in enumerate(columns)]
    for line in [columns, *cells]:
        print("  " + "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)))


def _sections(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if not names or unknown:
        msg = f"must name sections among {', '.join(SECTIONS)}, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return names


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run the sections; print a table each, write JSON and return the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_path", nargs="?", help="the trace (.jsonl)")
    parser.add_argument("--trace", dest="trace_option", help="the trace (same as the positional)")
    parser.add_argument(
        "--sections",
        type=_sections,
        default=list(SECTIONS),
        help=f"comma-separated sections to run, among {', '.join(SECTIONS)} (all)",
    )
    parser.add_argument(
        "--repeat", type=int_at_least(1), default=3, help="repetitions (median reported)"
    )
    replay = parser.add_argument_group("replay section")
    replay.add_argument("--workers", type=int_at_least(2), default=2, help="worker processes (2)")
    replay.add_argument("--stages", type=int_at_least(1), default=4, help="pipeline stages (4)")
    replay.add_argument(
        "--capacities",
        type=_capacities,
        default=list(REPLAY_CAPACITIES),
        help="tokens per stage, comma-separated; 0 = unbounded (1000000,3000000,10000000,0)",
    )
    replay.add_argument("--limit-requests", type=int_at_least(1), default=None)
    parser.add_argument("--json", default=f"benchmarks/out/{NAME}.json")
    args = parser.parse_args(argv)
    args.trace = args.trace_option or args.trace_path
    if NEEDS_TRACE.intersection(args.sections):
        if args.trace is None:
            parser.error("a trace path is required (positional or --trace)")
        if not Path(args.trace).is_file():
            parser.error(f"cannot read trace {args.trace}: no such file")

    # Warnings only: the library logs every record and eviction at info/debug (and the
    # replay's worker processes log at this process's level).
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(30), cache_logger_on_first_use=True
    )
    sections: dict[str, dict[str, Any]] = {}
    goals: list[dict[str, Any]] = []
    for name in args.sections:
        result = SECTIONS[name](args)
        sections[name] = result
        goals += [{**goal, "section": name} for goal in result.get("goals", [])]
        print_table(result.get("title", name), result["rows"])
        for note in result.get("notes", []):
            print(f"  {note}")
        for goal in result.get("goals", []):
            verdict = "met" if goal["met"] else "MISSED"
            print(f"  goal {goal['name']}: {goal['measured']} (target {goal['target']}) {verdict}")
    out: dict[str, object] = {
        "benchmark": NAME,
        "trace": args.trace,
        "repeat": args.repeat,
        "sections": sections,
        "goals": goals,
        "machine": _machine(),
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return out


if __name__ == "__main__":
    main()
