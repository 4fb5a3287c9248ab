"""Run every ``benchmarks/bench_*.py`` and collect their results in ``benchmarks/results.json``.

Each benchmark runs in its own process (so peak-RSS figures are its own) with
``--json benchmarks/out/<name>.json``; benchmarks that take a trace (``TAKES_TRACE = True``, or
a ``--trace`` option in their source) also get ``--trace PATH``, and are skipped without one. A
script that sets ``RUNS = {name: [arguments...], ...}`` (a literal) runs once per entry, each
under its own name with its own arguments (``bench_replay.py``: the ladder and the paged
index).

Usage::

    python benchmarks/run.py --trace ../shared/traces/synthetic_trace.jsonl
    python benchmarks/run.py --only replay --output benchmarks/results.json
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _takes_trace(script: Path) -> bool:
    source = script.read_text(encoding="utf-8")
    return "TAKES_TRACE = True" in source or '"--trace"' in source


def runs_of(script: Path) -> dict[str, list[str]]:
    """The runs of ``script``: its ``RUNS`` literal, or one run under its own name."""
    for node in ast.parse(script.read_text(encoding="utf-8")).body:
        target: ast.expr | None = None
        value: ast.expr | None = None
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        if isinstance(target, ast.Name) and target.id == "RUNS" and value is not None:
            runs = ast.literal_eval(value)
            return {str(name): [str(arg) for arg in arguments] for name, arguments in runs.items()}
    return {script.stem.removeprefix("bench_"): []}


def discover(only: list[str] | None = None) -> list[Path]:
    """The benchmark scripts, sorted by name (``only``: just those names, without ``bench_``)."""
    scripts = sorted(HERE.glob("bench_*.py"))
    if only:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in only]
    return scripts


def _machine() -> dict[str, str]:
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    for name in ("numpy", "trio", "blake3"):
        try:
            info[name] = version(name)
        except Exception:  # a missing package is just not recorded
            info[name] = "not installed"
    return info


def _scalars(result: object) -> str:
    if not isinstance(result, dict):
        return ""
    preferred = ["wall_s", "floor_s", "ratio_to_floor", "tokens_per_s", "peak_rss_bytes"]
    keys = [k for k in preferred if k in result]
    keys += [k for k in result if k not in preferred]
    shown: list[str] = []
    for key in keys:
        value = result[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        shown.append(f"{key}={value:,.3g}" if isinstance(value, float) else f"{key}={value:,}")
    return ", ".join(shown[:6])


def goal_rows(name: str, result: object) -> list[tuple[str, str, str, str, str]]:
    """(benchmark, goal, target, measured, MET/MISSED) for each goal a benchmark recorded.

    A benchmark records its goals as ``"goals": [{"name", "target", "measured", "met"}]``; a
    missed goal is reported, never hidden (the run itself still succeeds).
    """
    if not isinstance(result, dict):
        return []
    goals = result.get("goals", [])
    if isinstance(goals, dict):  # keyed by name, perhaps measured per capacity (bench_paged)
        goals = [{"name": key, **value} for key, value in goals.items() if isinstance(value, dict)]
    rows = []
    for goal in goals:
        if not isinstance(goal, dict):
            continue
        label = str(goal.get("name", "?"))
        if goal.get("required") is False:
            label += " (stretch)"
        met = goal.get("met")
        verdict = "MET" if met is True else "NOT RUN" if met is None and "met" in goal else "MISSED"
        rows.append((name, label, str(goal.get("target", "?")), _measured(goal), verdict))
    return rows


def _measured(goal: dict[str, object]) -> str:
    """The goal's measurement; per capacity, each capacity's first figure and verdict."""
    per_capacity = goal.get("per_capacity")
    if "measured" in goal or not isinstance(per_capacity, dict):
        value = goal.get("measured", "?")
        return f"{value:.3g}" if isinstance(value, float) else str(value)
    parts = []
    for capacity, row in per_capacity.items():
        if not isinstance(row, dict):
            continue
        figure = next((v for k, v in row.items() if k != "met" and isinstance(v, float)), None)
        label = "unbounded" if capacity == "0" else capacity
        shown = "?" if figure is None else f"{figure:.3g}"
        parts.append(f"{label}: {shown}{'' if row.get('met') else ' (missed)'}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run the benchmarks; print a summary and write the combined JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", help="trace for the benchmarks that take one")
    parser.add_argument("--only", action="append", help="run only this benchmark (repeatable)")
    parser.add_argument("--output", default=str(HERE / "results.json"))
    parser.add_argument("--out-dir", default=str(HERE / "out"), help="per-benchmark JSON files")
    parser.add_argument(
        "extra", nargs=argparse.REMAINDER, help="arguments after -- go to every benchmark"
    )
    args = parser.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]
    known = [script.stem.removeprefix("bench_") for script in discover()]
    unknown = sorted(set(args.only or ()) - set(known))
    if unknown:
        parser.error(f"--only must name benchmarks among {', '.join(known)}, got {unknown}")
    if args.trace is not None and not Path(args.trace).is_file():
        parser.error(f"cannot read trace {args.trace}: no such file")

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, object] = {}
    summary: list[tuple[str, str, float, str]] = []
    goals: list[tuple[str, str, str, str, str]] = []
    runs = [
        (script, name, arguments)
        for script in discover(args.only)
        for name, arguments in runs_of(script).items()
    ]
    for script, name, arguments in runs:
        json_path = out_dir / f"{name}.json"
        command = [sys.executable, str(script), "--json", str(json_path), *arguments, *extra]
        if _takes_trace(script):
            if args.trace is None:
                results[name] = {"status": "skipped", "reason": "needs --trace"}
                summary.append((name, "skipped", 0.0, "needs --trace PATH"))
                continue
            command += ["--trace", args.trace]
        started = time.perf_counter()
        completed = subprocess.run(command, capture_output=True, text=True, check=False)
        elapsed = time.perf_counter() - started
        sys.stdout.write(completed.stdout)
        if completed.returncode != 0 or not json_path.exists():
            tail = completed.stderr.strip().splitlines()[-1:] or ["no output"]
            results[name] = {
                "status": "failed",
                "returncode": completed.returncode,
                "error": tail[0],
            }
            summary.append((name, "FAILED", elapsed, tail[0]))
            continue
        result = json.loads(json_path.read_text(encoding="utf-8"))
        results[name] = {"status": "ok", "elapsed_s": elapsed, "result": result}
        summary.append((name, "ok", elapsed, _scalars(result)))
        goals += goal_rows(name, result)

    document = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": _machine(),
        "trace": args.trace,
        "benchmarks": results,
        "goals_met": sum(row[4] == "MET" for row in goals),
        "goals_missed": [f"{row[0]}: {row[1]}" for row in goals if row[4] == "MISSED"],
    }
    Path(args.output).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(f"\n{'benchmark':<20} {'status':<8} {'time':>8}  figures")
    for name, status, elapsed, figures in summary:
        print(f"{name:<20} {status:<8} {elapsed:>7.1f}s  {figures}")
    if goals:
        width = max(len(row[1]) for row in goals)
        print(f"\n{'benchmark':<10} {'goal':<{width}} {'verdict':<8} measured")
        for bench, goal, target, measured, verdict in goals:
            print(f"{bench:<10} {goal:<{width}} {verdict:<8} {measured}\n{'':<11}target: {target}")
        met = sum(row[4] == "MET" for row in goals)
        missed = sum(row[4] == "MISSED" for row in goals)
        print(f"{met} of {len(goals)} goals met, {missed} missed")
    print(f"results written to {args.output}")
    return document


if __name__ == "__main__":
    main()
