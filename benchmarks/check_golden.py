"""Check that the stage caches still behave as the golden fingerprints say (or write them).

Replays a trace with each cache policy (ladder, paged LRU, paged reuse; 4 stages) at each
capacity and compares every restore, record, eviction, counter and log event with the golden
fingerprints (see ``tests/stage_runtime/golden/fingerprint.py``). Exits 0 when they are all
equal, 1 with a summary of what differs (which stages and parts, the counts, and the requests
where behaviour first parted), 2 on a usage error.

Usage::

    python benchmarks/check_golden.py ../shared/traces/synthetic_trace.jsonl
    python benchmarks/check_golden.py --excerpt              # the bundled excerpt (tests do this)
    python benchmarks/check_golden.py TRACE --workers 2      # scenarios in 2 processes
    python benchmarks/check_golden.py TRACE --write          # regenerate the golden file
    python benchmarks/check_golden.py TRACE --only ladder@1000000 --dump /tmp/now

The golden file of a trace is ``benchmarks/golden/<trace name>.json`` (the excerpt's is
``tests/stage_runtime/golden/excerpt.json``). Write it from the code whose behaviour is the
reference, never to make a check pass. ``--dump DIR`` writes every hashed item of each scenario
to ``DIR/<scenario>.txt``: dump from two versions of the code (two worktrees) and ``diff`` them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the fingerprints live with the tests
    sys.path.insert(0, str(ROOT))

from stage_runtime._cli_support import int_at_least  # noqa: E402
from stage_runtime.sim import SimRequest, read_demo_trace, read_trace  # noqa: E402
from tests.stage_runtime.golden.fingerprint import (  # noqa: E402
    EXCERPT_CAPACITIES,
    FORMAT,
    TRACE_CAPACITIES,
    Scenario,
    compare,
    fingerprint,
    golden_document,
    scenarios,
)

EXCERPT_GOLDEN = ROOT / "tests" / "stage_runtime" / "golden" / "excerpt.json"
"""The bundled excerpt's golden fingerprints."""

GOLDEN_DIR = ROOT / "benchmarks" / "golden"
"""Where a trace's golden fingerprints live, as ``<trace name>.json``."""


def _fingerprints(
    requests: Sequence[SimRequest],
    chosen: Sequence[Scenario],
    *,
    workers: int,
    dump: Path | None,
) -> list[dict[str, Any]]:
    """Fingerprint every scenario (in ``workers`` fresh processes when more than one), in the
    order given, printing each as it finishes."""

    def path(scenario: Scenario) -> Path | None:
        return None if dump is None else dump / f"{scenario.name}.txt"

    def shown(found: dict[str, Any], elapsed: float) -> None:
        name = Scenario(**found["scenario"]).name
        print(f"  {name:<24} {found['digest'][:16]}  {elapsed:6.1f} s", flush=True)

    started = time.perf_counter()
    if workers == 1:
        results = []
        for scenario in chosen:
            found = fingerprint(requests, scenario, dump=path(scenario))
            shown(found, time.perf_counter() - started)
            results.append(found)
        return results
    # Fresh (spawned) processes: nothing there has configured or cached a logger.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = {
            pool.submit(fingerprint, requests, scenario, dump=path(scenario)): scenario
            for scenario in chosen
        }
        done: dict[Scenario, dict[str, Any]] = {}
        for future in concurrent.futures.as_completed(futures):
            done[futures[future]] = future.result()
            shown(done[futures[future]], time.perf_counter() - started)
    return [done[scenario] for scenario in chosen]


def main(argv: list[str] | None = None) -> int:
    """Check (or with ``--write``, write) the golden fingerprints; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", help="the trace (.jsonl)")
    parser.add_argument(
        "--excerpt", action="store_true", help="the excerpt bundled with the package"
    )
    parser.add_argument("--golden", help="the golden file (default: see above)")
    parser.add_argument(
        "--capacity",
        type=int_at_least(0),
        action="append",
        help="per-stage capacity in tokens, repeatable (with --write; default 1M and 3M, "
        f"{EXCERPT_CAPACITIES[0]:,} and {EXCERPT_CAPACITIES[1]:,} for the excerpt)",
    )
    parser.add_argument(
        "--only", action="append", help="check only this scenario (e.g. ladder@1000000)"
    )
    parser.add_argument("--workers", type=int_at_least(1), default=1, help="processes (1)")
    parser.add_argument("--write", action="store_true", help="write the golden file instead")
    parser.add_argument("--dump", help="write every hashed item to DIR/<scenario>.txt")
    args = parser.parse_args(argv)
    if (args.trace is None) == (not args.excerpt):
        parser.error("give a trace path or --excerpt (one of them)")
    if args.write and args.only:
        parser.error("--write writes every scenario; --only is for checking")
    if args.capacity and not args.write:
        parser.error("--capacity picks what --write fingerprints; a check takes the golden's")
    if args.trace is not None and not Path(args.trace).is_file():
        parser.error(f"cannot read trace {args.trace}: no such file")
    if args.excerpt:
        trace_name, requests = "excerpt", list(read_demo_trace().requests)
        golden_path = Path(args.golden) if args.golden else EXCERPT_GOLDEN
        capacities = args.capacity or list(EXCERPT_CAPACITIES)
    else:
        trace_name, requests = Path(args.trace).name, list(read_trace(args.trace).requests)
        golden_path = (
            Path(args.golden) if args.golden else GOLDEN_DIR / f"{Path(args.trace).stem}.json"
        )
        capacities = args.capacity or list(TRACE_CAPACITIES)

    golden: dict[str, Any] | None = None
    if args.write:
        chosen = scenarios(capacities)
    else:
        if not golden_path.is_file():
            parser.error(f"no golden file {golden_path}: --write creates it")
        golden = json.loads(golden_path.read_text(encoding="utf-8"))
        if golden.get("format") != FORMAT:
            parser.error(f"{golden_path} has format {golden.get('format')!r}, expected {FORMAT}")
        known = {name: Scenario(**found["scenario"]) for name, found in golden["scenarios"].items()}
        unknown = sorted(set(args.only or ()) - set(known))
        if unknown:
            parser.error(f"--only must name scenarios among {', '.join(known)}, got {unknown}")
        chosen = [known[name] for name in args.only or known]
    dump = None
    if args.dump is not None:
        dump = Path(args.dump)
        dump.mkdir(parents=True, exist_ok=True)

    print(
        f"{trace_name}: {len(requests):,} requests, {len(chosen)} scenarios, "
        f"{args.workers} process{'es' if args.workers > 1 else ''}"
    )
    found = _fingerprints(requests, chosen, workers=args.workers, dump=dump)
    document = golden_document(trace_name, requests, found)
    if golden is None:
        golden_path.parent.mkdir(parents=True, exist_ok=True)
        golden_path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        print(f"golden fingerprints written to {golden_path}")
        return 0
    checked = {**golden, "scenarios": {s.name: golden["scenarios"][s.name] for s in chosen}}
    differences = compare(checked, document)
    if differences:
        print(f"{len(differences)} differences from {golden_path}:")
        for line in differences:
            print(f"  {line}")
        return 1
    print(f"all {len(chosen)} fingerprints equal the golden ones ({golden_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
