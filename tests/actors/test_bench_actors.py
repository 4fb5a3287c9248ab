"""The actors benchmark runs end to end (tiny sizes: a smoke test, nothing is timed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_actors.py"


def test_bench_actors_writes_comparable_json(tmp_path: Path) -> None:
    """main() returns and writes ask and tell figures side by side, with machine and versions."""
    spec = importlib.util.spec_from_file_location("bench_actors", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "actors.json"
    result = module.main(["--reps", "1", "--asks", "20", "--tells", "20", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["ask"]["round_trip_us"].keys() == {"actor", "channels", "locked"}
    assert set(written["tell"]) == {"0", "64", "1024"}
    assert written["machine"]["versions"]["trio"]
    assert result["reps"] == written["reps"] == 1
