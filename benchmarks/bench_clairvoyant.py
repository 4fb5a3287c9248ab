"""The clairvoyant ceiling of a trace at several capacities, against the issue's figures.

For each capacity (tokens per stage), the hit ratio a clairvoyant (Belady) cache of pages of the
block size would reach on the trace (``stage_runtime.sim.clairvoyant``), next to the infinite
cache's (the theoretical maximum), and the seconds the computation took: one backward pass for
the next uses, one forward pass per capacity.

Goal (issue 22): reproduce the issue's figures for the synthetic trace, at 512-token blocks,
within 0.002: 0.383 at 1M tokens, 0.560 at 3M, 0.651 at 10M (the goals are checked only for
that trace, recognised by its file name).

Usage::

    python benchmarks/bench_clairvoyant.py ../shared/traces/synthetic_trace.jsonl
    python benchmarks/bench_clairvoyant.py TRACE --capacities 1000000,3000000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Final

from stage_runtime._cli_support import int_at_least
from stage_runtime.sim import read_trace, theoretical_max_hit_ratio
from stage_runtime.sim.clairvoyant import capacity_pages, clairvoyant_hits, plan

TAKES_TRACE = True
"""``benchmarks/run.py`` passes ``--trace PATH`` to benchmarks that set this."""

NAME = "clairvoyant"

ISSUE_FIGURES: Final = {1_000_000: 0.383, 3_000_000: 0.560, 10_000_000: 0.651}
"""The issue's clairvoyant figures for the synthetic trace (block level, 512-token blocks)."""

TOLERANCE: Final = 0.002


def _capacities(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or any(value < 0 for value in values):
        msg = f"must be a comma-separated list of integers >= 0, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return values


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print a table, write JSON and return the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_path", nargs="?", help="the trace (.jsonl)")
    parser.add_argument("--trace", dest="trace_option", help="the trace (same as the positional)")
    parser.add_argument(
        "--capacities",
        type=_capacities,
        default=list(ISSUE_FIGURES),
        help="tokens per stage, comma-separated (0: unbounded; default 1M,3M,10M)",
    )
    parser.add_argument("--block-size", type=int_at_least(1), default=512)
    parser.add_argument("--json", default=f"benchmarks/out/{NAME}.json")
    args = parser.parse_args(argv)
    trace_path = args.trace_option or args.trace_path
    if trace_path is None:
        parser.error("a trace path is required (positional or --trace)")
    if not Path(trace_path).is_file():
        parser.error(f"cannot read trace {trace_path}: no such file")

    requests = list(read_trace(trace_path).requests)
    started = time.perf_counter()
    workload = plan(requests, block_size=args.block_size)
    plan_s = time.perf_counter() - started
    infinite = theoretical_max_hit_ratio(requests, block_size=args.block_size)
    checked = Path(trace_path).name == "synthetic_trace.jsonl" and args.block_size == 512
    rows = []
    goals = []
    for capacity in args.capacities:
        started = time.perf_counter()
        result = clairvoyant_hits(workload, capacity_pages(capacity, args.block_size))
        seconds = time.perf_counter() - started
        expected = ISSUE_FIGURES.get(capacity) if checked else None
        rows.append(
            {
                "capacity_tokens": capacity,
                "capacity_pages": result.capacity_pages,
                "clairvoyant_hit_ratio": result.ratio,
                "clairvoyant_hit_tokens": result.hit_tokens,
                "issue_figure": expected,
                "seconds": seconds,
            }
        )
        if expected is not None:
            goals.append(
                {
                    "name": f"clairvoyant hit ratio at {capacity:,} tokens",
                    "target": f"{expected} +- {TOLERANCE}",
                    "measured": round(result.ratio, 4),
                    "met": abs(result.ratio - expected) <= TOLERANCE,
                }
            )
    print(
        f"clairvoyant ceiling of {trace_path}: {len(requests):,} requests, "
        f"{workload.prompt_tokens:,} prompt tokens, blocks of {args.block_size} tokens "
        f"(next uses in {plan_s:.2f} s)"
    )
    print(f"  {'capacity (tokens)':>18} {'pages':>8} {'clairvoyant':>12} {'issue':>7} {'s':>6}")
    for row in rows:
        shown = "unbounded" if row["capacity_tokens"] == 0 else f"{row['capacity_tokens']:,}"
        issue = "-" if row["issue_figure"] is None else f"{row['issue_figure']:.3f}"
        print(
            f"  {shown:>18} {row['capacity_pages']:>8,} {row['clairvoyant_hit_ratio']:>12.4f} "
            f"{issue:>7} {row['seconds']:>6.2f}"
        )
    print(f"  infinite cache (theoretical maximum): {infinite.ratio:.4f}")
    for goal in goals:
        verdict = "met" if goal["met"] else "MISSED"
        print(f"  goal {goal['name']}: {goal['measured']} ({goal['target']}) {verdict}")
    document: dict[str, Any] = {
        "benchmark": NAME,
        "trace": str(trace_path),
        "requests": len(requests),
        "prompt_tokens": workload.prompt_tokens,
        "block_size": args.block_size,
        "plan_s": plan_s,
        "theoretical_max_hit_ratio": infinite.ratio,
        "capacities": rows,
        "goals": goals,
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return document


if __name__ == "__main__":
    main(sys.argv[1:])
