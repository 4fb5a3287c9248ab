"""bench_trace_parse: both parsers over the bundled excerpt, one JSON document (not timed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_script


def test_one_run_times_both_parsers_and_writes_the_table_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One run measures json and msgspec side by side over the excerpt (and a given trace),
    prints one table row per trace and writes the same figures as JSON."""
    extra = tmp_path / "two.jsonl"
    extra.write_text(
        '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n\n'
        '{"timestamp": 5, "input_length": 600, "output_length": 0, "hash_ids": [1, 2]}\n',
        encoding="utf-8",
    )
    out = tmp_path / "out" / "trace_parse.json"
    result = load_script("bench_trace_parse").main(
        [str(extra), "--repeat", "1", "--json", str(out)]
    )
    written = json.loads(out.read_text(encoding="utf-8"))
    assert written == json.loads(json.dumps(result))
    rows = written["traces"]
    assert [(Path(row["trace"]).name, row["lines"]) for row in rows] == [
        ("mooncake_synthetic_excerpt.jsonl", 300),
        ("two.jsonl", 2),
    ]
    for row in rows:
        assert row["json_s"] > 0
        assert row["msgspec_s"] > 0
        assert row["speedup"] == pytest.approx(row["json_s"] / row["msgspec_s"])
    table = capsys.readouterr().out
    assert re.search(r"^mooncake_synthetic_excerpt\.jsonl +300 ", table, re.MULTILINE)
    assert "msgspec ms" in table
