"""Benchmark: reading trace lines with the standard library's json against msgspec.

Run: ``python benchmarks/bench_trace_parse.py [TRACE.jsonl ...] [--repeat 7] [--json PATH]``.

Each trace (the bundled excerpt, then any paths given) is read into memory as raw lines, then
parsed into :class:`~stage_runtime.sim.SimRequest` objects three ways, side by side in one run:

- ``json``: the checked path, the standard library's ``json.loads`` and a Python check of every
  field (what :func:`~stage_runtime.sim.parse_trace_line` did for every line before msgspec);
- ``msgspec``: each line as :func:`~stage_runtime.sim.read_trace` parses it (what
  :func:`~stage_runtime.sim.parse_trace_line` does once its settings are checked): msgspec's
  typed decode and the few range checks it leaves (lines it declines fall back to the checked
  path);
- ``decode only``: ``json.loads`` and ``msgspec.json.decode`` alone, without building requests,
  for scale.

Numbers are medians over ``--repeat`` samples; each sample parses the whole file enough times to
last ~50 ms. File reading is not timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec

from stage_runtime._cli_support import int_at_least
from stage_runtime.data import DEMO_TRACE, demo_trace
from stage_runtime.sim.trace import _parse_checked, _parse_line, parse_trace_line

NAME = "trace_parse"
BLOCK_SIZE = 512


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    out["machine"] = platform.machine()
    for dist in ("msgspec", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _median_seconds(fn: Callable[[], object], repeat: int, budget_s: float = 0.05) -> float:
    """Median seconds per call over ``repeat`` samples of enough calls to fill ``budget_s``."""
    fn()  # warm up
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    loops = max(1, int(budget_s / once))
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter() - start) / loops)
    return statistics.median(samples)


def _with_json(lines: list[bytes]) -> int:
    count = 0
    for number, raw in enumerate(lines, start=1):
        _parse_checked(
            raw, path="t", line=number, index=count, block_size=BLOCK_SIZE, max_input_length=None
        )
        count += 1
    return count


def _with_msgspec(lines: list[bytes]) -> int:
    count = 0
    for number, raw in enumerate(lines, start=1):
        # As read_trace parses each line: its settings are checked once per file, not here.
        _parse_line(
            raw, path="t", line=number, index=count, block_size=BLOCK_SIZE, max_input_length=None
        )
        count += 1
    return count


def bench_file(name: str, data: bytes, repeat: int) -> dict[str, Any]:
    """Time both parsers (and both bare decoders) over the non-blank lines of ``data``."""
    lines = [line for line in data.splitlines() if line.strip()]
    # The two parsers must agree before their speed means anything.
    assert [
        parse_trace_line(raw, line=n, index=n, block_size=BLOCK_SIZE)
        for n, raw in enumerate(lines, start=1)
    ] == [
        _parse_checked(raw, path="t", line=n, index=n, block_size=BLOCK_SIZE, max_input_length=None)
        for n, raw in enumerate(lines, start=1)
    ]
    json_s = _median_seconds(lambda: _with_json(lines), repeat)
    msgspec_s = _median_seconds(lambda: _with_msgspec(lines), repeat)
    decoder = msgspec.json.Decoder()
    json_decode_s = _median_seconds(lambda: [json.loads(raw) for raw in lines], repeat)
    msgspec_decode_s = _median_seconds(lambda: [decoder.decode(raw) for raw in lines], repeat)
    return {
        "trace": name,
        "lines": len(lines),
        "bytes": len(data),
        "json_s": json_s,
        "msgspec_s": msgspec_s,
        "speedup": json_s / msgspec_s,
        "json_us_per_line": json_s / len(lines) * 1e6,
        "msgspec_us_per_line": msgspec_s / len(lines) * 1e6,
        "json_decode_only_s": json_decode_s,
        "msgspec_decode_only_s": msgspec_decode_s,
    }


def _table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'trace':<40} {'lines':>6} {'json ms':>9} {'msgspec ms':>11} {'speedup':>8} "
        f"{'decode-only json/msgspec ms':>28}"
    )
    out = [header, "-" * len(header)]
    for row in rows:
        bare = f"{row['json_decode_only_s'] * 1e3:.2f} / {row['msgspec_decode_only_s'] * 1e3:.2f}"
        out.append(
            f"{Path(row['trace']).name:<40} {row['lines']:>6} {row['json_s'] * 1e3:>9.2f} "
            f"{row['msgspec_s'] * 1e3:>11.2f} {row['speedup']:>7.1f}x {bare:>28}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Time both parsers over each trace, print a table, write JSON; returns the JSON document."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("traces", nargs="*", type=Path, help="more traces (.jsonl) to time")
    parser.add_argument(
        "--repeat", type=int_at_least(1), default=7, help="samples per measurement (median)"
    )
    parser.add_argument(
        "--json", type=Path, default=Path(f"benchmarks/out/{NAME}.json"), help="output file"
    )
    args = parser.parse_args(argv)
    sources = [(f"stage_runtime/data/{DEMO_TRACE}", demo_trace().read_bytes())]
    for path in args.traces:
        try:
            sources.append((str(path), path.read_bytes()))
        except OSError as exc:
            parser.error(f"cannot read trace {path}: {exc.strerror}")

    rows = [bench_file(name, data, args.repeat) for name, data in sources]
    result: dict[str, object] = {
        "benchmark": NAME,
        "repeat": args.repeat,
        "environment": _versions(),
        "traces": rows,
    }
    print(_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
