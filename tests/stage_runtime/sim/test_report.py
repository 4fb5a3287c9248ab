"""Reports: the JSON keys programs depend on, the tables people read, the plot."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from rich.console import Console

from stage_runtime.sim import (
    CostModel,
    ReplayResult,
    SimConfig,
    SimRequest,
    render_report,
    render_sweep,
    result_to_json,
    run_replay,
    run_sweep,
    sweep_order,
    write_plot,
)

TRACE = [
    SimRequest(index=0, input_length=40, block_ids=(1, 2, 3)),
    SimRequest(index=1, input_length=40, block_ids=(1, 2, 4)),
]
CONFIG = SimConfig(
    stages=2, block_size=16, bytes_per_token=2, cost=CostModel(prefill_s_per_token=1e-3)
)


@pytest.fixture(scope="module")
def result() -> ReplayResult:
    """One small replay shared by the report tests."""
    return run_replay(TRACE, CONFIG)


def test_json_has_the_stable_keys(result: ReplayResult) -> None:
    """The issue's keys are all there, with the values of the replay, and it round-trips."""
    document = result_to_json(result, source={"kind": "trace", "path": "t.jsonl"})
    assert {
        "requests",
        "prompt_tokens",
        "restored_tokens",
        "token_hit_ratio",
        "theoretical_max_hit_ratio",
        "stages",
        "ttft_s",
        "wall_s",
        "tokens_per_s",
        "config",
    } <= set(document)
    assert (document["requests"], document["prompt_tokens"], document["restored_tokens"]) == (
        2,
        80,
        32,
    )
    stages = document["stages"]
    assert isinstance(stages, list)
    assert len(stages) == 2
    assert {
        "stage_id",
        "restored_tokens",
        "computed_tokens",
        "records",
        "evictions",
        "resident_bytes_max",
        "misses",
        "resident_bytes",
        "unique_prefix_bytes",
        "residency_ratio",
    } <= set(stages[0])
    assert stages[0]["misses"] == {"never_seen": 1, "evicted": 0, "rejected": 0}
    ttft = document["ttft_s"]
    assert isinstance(ttft, dict)
    assert set(ttft) == {"p50", "p90", "p99"}
    assert set(ttft["p99"]) == {"cached", "uncached"}
    config = document["config"]
    assert isinstance(config, dict)
    assert config["min_tokens"] == 16
    assert config["stride_tokens"] == 16
    assert config["source"] == {"kind": "trace", "path": "t.jsonl"}
    assert json.loads(json.dumps(document)) == document


def test_report_shows_ratios_stages_and_ttft(result: ReplayResult) -> None:
    """The human report names the totals, every stage and the TTFT percentiles."""
    console = Console(record=True, width=140)
    render_report(console, result, title="test replay", skipped_lines=3)
    text = console.export_text()
    for fragment in (
        "test replay",
        "token hit ratio",
        "40.0%",
        "theoretical max",
        "stage-1",
        "skipped bad lines",
        "p99",
        "without cache",
        "tokens/s",
    ):
        assert fragment in text


@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_report_shows_misses_by_reason_and_resident_vs_unique_bytes(index: str) -> None:
    """A prompt pushed out by another misses as 'evicted'; JSON and table show the footprint."""
    # 40 tokens: ladder rungs 40 and 32 (2 entries); paged: 2 pages of 16 and a tail (3).
    config = attrs.evolve(CONFIG, index=index, max_entries=2 if index == "ladder" else 3)
    trace = [
        SimRequest(index=0, input_length=40, block_ids=(1, 2, 3)),
        SimRequest(index=1, input_length=40, block_ids=(7, 8, 9)),
        SimRequest(index=2, input_length=40, block_ids=(1, 2, 3)),
    ]
    result = run_replay(trace, config)
    stages = result_to_json(result)["stages"]
    assert isinstance(stages, list)
    rows = 40 + 32 if index == "ladder" else 40  # what stays resident: the last prompt
    for stage in stages:
        assert stage["misses"] == {"never_seen": 2, "evicted": 1, "rejected": 0}
        assert (stage["resident_bytes"], stage["unique_prefix_bytes"]) == (rows * 2, 40 * 2)
        assert stage["residency_ratio"] == pytest.approx(rows / 40)
    console = Console(record=True, width=140)
    render_report(console, result, title="evictions")
    text = console.export_text()
    assert "misses: never seen/evicted/rejected" in text
    assert "2/1/0" in text
    assert f"{rows * 2} B / 80 B ({rows / 40:.2f}x)" in text


def test_sweep_report_has_a_row_per_capacity() -> None:
    """The sweep table lists each capacity, unbounded included."""
    results = run_sweep(TRACE, CONFIG, [8, 0])
    console = Console(record=True, width=200)
    render_sweep(console, results, title="sweep")
    text = console.export_text()
    assert "8 tokens" in text
    assert "unbounded" in text
    assert "resident / unique" in text


def test_sweep_report_sorts_capacities_and_lists_evictions_stage_by_stage() -> None:
    """Rows go by increasing capacity with unbounded last; evictions are per stage, not summed."""
    results = run_sweep(TRACE, CONFIG, [0, 40, 8])
    assert [r.capacity_tokens for r in sweep_order(results)] == [8, 40, 0]
    console = Console(record=True, width=200)
    render_sweep(console, results, title="sweep")
    text = console.export_text()
    rows = [line.split() for line in text.splitlines()]
    rows = [row for row in rows if row and (row[0] == "unbounded" or row[1:2] == ["tokens"])]
    assert [row[0] for row in rows] == ["8", "40", "unbounded"]
    smallest = sweep_order(results)[0]
    per_stage = " / ".join(f"{stage.evictions:,}" for stage in smallest.stages)
    assert sum(stage.evictions for stage in smallest.stages) > 0
    assert per_stage in " ".join(rows[0])


def test_plots_are_png_files(tmp_path: Path, result: ReplayResult) -> None:
    """A single run and a sweep both write PNG files."""
    single, sweep = tmp_path / "single.png", tmp_path / "sweep.png"
    write_plot([result], single)
    write_plot(run_sweep(TRACE, CONFIG, [8, 0]), sweep)
    for path in (single, sweep):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
