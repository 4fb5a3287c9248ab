"""benchmarks/run.py runs bench_replay end to end (a tiny trace: a smoke test, nothing timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RUN = Path(__file__).parents[3] / "benchmarks" / "run.py"


def test_run_collects_the_replay_benchmark(tmp_path: Path) -> None:
    """run.py passes --trace to bench_replay and gathers its figures next to the floor."""
    trace = tmp_path / "tiny.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 900, "output_length": 1, "hash_ids": [1, 2]},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    output = tmp_path / "results.json"
    done = subprocess.run(
        [
            sys.executable,
            str(RUN),
            "--trace",
            str(trace),
            "--only",
            "replay",
            "--output",
            str(output),
            "--out-dir",
            str(tmp_path / "out"),
            "--",
            "--repeat",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(output.read_text(encoding="utf-8"))
    replay = document["benchmarks"]["replay"]
    assert replay["status"] == "ok", replay
    result = replay["result"]
    assert result["requests"] == 2
    assert result["prompt_tokens"] == 1600
    assert result["floor_s"] > 0
    assert result["ratio_to_floor"] == result["wall_s"] / result["floor_s"]
    assert result["peak_rss_bytes"] > 0
    assert result["machine"]["trio"]
    assert "replay" in done.stdout
