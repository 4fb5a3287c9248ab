"""benchmarks/bench_paged.py end to end on a tiny trace (a smoke test: nothing is timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_paged.py"

# Three prompts over 512-token blocks: the third shares two blocks with the first.
TRACE = [
    {"timestamp": 0, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]},
    {"timestamp": 2, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 9]},
]


def test_bench_paged_writes_json_and_a_plot(tmp_path: Path) -> None:
    """The benchmark compares all indexes per capacity and writes its JSON and PNG."""
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in TRACE) + "\n", encoding="utf-8")
    out = tmp_path / "paged.json"
    argv = [str(trace), "--capacities", "1024,0", "--repeat", "1", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(BENCH), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text(encoding="utf-8"))
    assert (tmp_path / "paged.png").stat().st_size > 0
    assert document["capacities"] == [1024, 0]
    unbounded = document["results"]["0"]
    # The third prompt restores its two shared blocks only with pages (the ladder recorded
    # 2048 and 1536 for the first prompt, not 1024).
    assert unbounded["paged"]["restored_tokens"] == 1024
    assert unbounded["ladder"]["restored_tokens"] == 0
    assert unbounded["paged"]["resident_bytes"] == unbounded["paged"]["unique_prefix_bytes"]
    assert document["checks"]["unbounded_paged_equals_theoretical_max"] is True
    assert "paged-reuse" in document["results"]["1024"]
    assert document["machine"]["blake3"]
    assert "ladder vs paged" in done.stdout
