"""Stages in other processes: what placing them there buys, side by side with one process.

Each section measures one thing in one run, repeated (medians quoted) and interleaved, so that
noise from other work on the machine spreads over both sides of every ratio:

- ``replay``: ``stage-runtime replay TRACE --index paged --stages 4 --sweep-capacity
  1000000,3000000,10000000,0`` with ``--workers 2`` against one process: the wall time of each
  (the same library calls the command makes, from the worker pool's start to its shutdown;
  reading the trace is not timed), their ratio (goal: at most 0.6 on 2 cores) and whether every
  result is identical (all of the JSON but ``wall_s`` and ``tokens_per_s``, and every request's
  restores and times).
- ``hops``: the round trip of a 2-stage pipeline of stages that do nothing (driver, stage 0,
  stage 1, driver), a 32-byte frame and a 16 MiB one, local against Ray.
- ``throughput``: 2 ``CausalMixModel`` stages at width 1,024, 64 prompts of 2,048 tokens at
  concurrency 8, BLAS threads pinned to one per process: local (the model computes large
  forwards in worker threads), local on one core (the model computes on the event loop) and Ray
  (two stage processes); goal: Ray at least 1.6x local on 2 cores. The Ray run's peak memory:
  the driver, each stage process and Ray's own processes, separately.

The ``hops`` and ``throughput`` sections run in a child process each (``_placement_pipeline.py``)
that pins BLAS threads before numpy loads and starts, then stops, its own Ray instance.

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
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import structlog

from stage_runtime._cli_support import int_at_least, int_between
from stage_runtime.limits import MAX_REFERENCE_WIDTH
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

THROUGHPUT_GOAL_RATIO = 1.6
"""The issue's goal: two Ray stage processes prefill at least this many times as fast as one
process on 2 cores."""

HERE = Path(__file__).resolve().parent

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


def _child_section(section: str, *options: str) -> dict[str, Any]:
    """Run ``_placement_pipeline.py section`` in a child process and return its JSON."""
    with tempfile.TemporaryDirectory(prefix="bench-placement-") as temp:
        out = Path(temp) / f"{section}.json"
        command = [sys.executable, str(HERE / "_placement_pipeline.py"), section, "--out", str(out)]
        done = subprocess.run([*command, *options], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            msg = f"the {section} section failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
            raise RuntimeError(msg)
        result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
        return result


def hops_section(args: argparse.Namespace) -> dict[str, Any]:
    """Round trips of do-nothing stages, local against Ray (no goal: what a hop costs)."""
    result = _child_section("hops", "--repeat", str(args.hop_repeat))
    return {
        "title": f"2-stage round trip of do-nothing stages; median of {args.hop_repeat}",
        "rows": result["rows"],
    }


def throughput_section(args: argparse.Namespace) -> dict[str, Any]:
    """Prefill throughput of 2 CausalMixModel stages, local against Ray, and the Ray run's
    peak memory."""
    result = _child_section(
        "throughput",
        "--repeat",
        str(args.throughput_repeat),
        "--prompts",
        str(args.prompts),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--width",
        str(args.width),
        "--concurrency",
        str(args.concurrency),
    )
    ratio = result["ray_over_local"]
    by_name = {row["placement"]: row for row in result["rows"]}
    local_speedup = by_name["local_one_core"]["wall_s"] / by_name["local"]["wall_s"]
    bound = result["two_stage_balance_bound"]
    memory = result["memory"]
    mib = 1 << 20
    stages = ", ".join(
        f"{stage} {size / mib:,.0f}" for stage, size in memory["stage_peak_rss_bytes"].items()
    )
    return {
        "title": (
            f"2 CausalMixModel stages, width {args.width:,}, {args.prompts} prompts of "
            f"{args.prompt_tokens:,} tokens, concurrency {args.concurrency}, one BLAS thread "
            f"per process; median of {args.throughput_repeat}"
        ),
        "rows": result["rows"],
        "ray_over_local": ratio,
        "ray_over_local_one_core": result["ray_over_local_one_core"],
        "stage_compute_s": result["stage_compute_s"],
        "two_stage_balance_bound": bound,
        "local_over_local_one_core": local_speedup,
        "ceiling_over_local": bound / local_speedup if bound else None,
        "memory": memory,
        "notes": [
            f"Ray / local on one core: {result['ray_over_local_one_core']:.2f}x; local (threads)"
            f" / local on one core: {local_speedup:.2f}x",
            f"two-stage balance bound (each stage's compute alone on one core, sum / larger):"
            f" {bound:.2f}x, so at most {bound / local_speedup:.2f}x over local"
            if bound
            else "",
            f"peak RSS of the Ray run (MiB): driver {memory['driver_peak_rss_bytes'] / mib:,.0f};"
            f" stages {stages}; Ray's own processes "
            f"{memory['ray_processes_total_bytes'] / mib:,.0f} in "
            f"{len(memory['ray_processes_peak_rss_bytes'])} processes",
        ],
        "goals": [
            {
                "name": "2-stage prefill throughput, Ray / one process",
                "target": f">= {THROUGHPUT_GOAL_RATIO:g}",
                "measured": round(ratio, 3),
                "met": ratio >= THROUGHPUT_GOAL_RATIO,
            }
        ],
    }


SECTIONS: dict[str, Section] = {
    "replay": replay_section,
    "hops": hops_section,
    "throughput": throughput_section,
}
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
    pipeline = parser.add_argument_group("hops and throughput sections")
    pipeline.add_argument(
        "--hop-repeat", type=int_at_least(1), default=50, help="round trips timed (50)"
    )
    pipeline.add_argument(
        "--throughput-repeat",
        type=int_at_least(1),
        default=1,
        help="repetitions of the three throughput runs (1; each is 3 x 64 prompts)",
    )
    pipeline.add_argument("--prompts", type=int_at_least(1), default=64, help="prompts (64)")
    pipeline.add_argument(
        "--prompt-tokens", type=int_at_least(64), default=2048, help="tokens per prompt (2048)"
    )
    pipeline.add_argument(
        "--width", type=int_between(1, MAX_REFERENCE_WIDTH), default=1024, help="width (1024)"
    )
    pipeline.add_argument(
        "--concurrency", type=int_at_least(1), default=8, help="prefills in flight (8)"
    )
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
            if note:
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
