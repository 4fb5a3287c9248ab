"""benchmarks/bench_placement.py end to end on a tiny trace (a smoke test: nothing is timed)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[3] / "benchmarks" / "bench_placement.py"

# Three prompts over 512-token blocks: the third shares two blocks with the first.
TRACE = [
    {"timestamp": 0, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]},
    {"timestamp": 2, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 9]},
]


def test_the_replay_section_compares_two_workers_with_one_process(tmp_path: Path) -> None:
    """The replay section times the sweep both ways, says the results are identical, and
    reports its goals as benchmarks/run.py reads them."""
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in TRACE) + "\n", encoding="utf-8")
    out = tmp_path / "placement.json"
    argv = [str(trace), "--sections", "replay", "--capacities", "1024,0", "--repeat", "1"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text(encoding="utf-8"))
    section = document["sections"]["replay"]
    assert (section["requests"], section["capacities"], section["workers"]) == (3, [1024, 0], 2)
    assert section["config"]["index"] == "paged"
    assert section["config"]["stages"] == 4
    assert section["identical_results"] is True
    one, fanned = section["rows"]
    assert (one["run"], fanned["run"]) == ("one process", "--workers 2")
    assert one["wall_s"] > 0
    assert fanned["cpu_s"] > 0  # the workers' CPU time is counted
    assert fanned["wall_over_one_process"] == pytest.approx(fanned["wall_s"] / one["wall_s"])
    ratio, identical = document["goals"]
    assert ratio["target"] == "<= 0.6"
    assert ratio["met"] == (fanned["wall_over_one_process"] <= 0.6)
    assert (identical["measured"], identical["met"]) == (True, True)
    assert {goal["section"] for goal in document["goals"]} == {"replay"}
    assert "--workers 2" in done.stdout
    assert "identical results: yes" in done.stdout
    assert document["machine"]["cpus"] >= 1


def test_the_pipeline_sections_compare_local_and_ray_and_report_memory(tmp_path: Path) -> None:
    """The hops and throughput sections run local and Ray side by side (tiny sizes), report
    the throughput goal and the Ray run's memory by process, and leave no Ray file behind."""
    pytest.importorskip("ray")
    out = tmp_path / "placement.json"
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("bp-ray-*")) | set(temp.glob("bench-placement-*"))
    argv = ["--sections", "hops,throughput", "--hop-repeat", "2", "--prompts", "3"]
    argv += ["--prompt-tokens", "64", "--width", "16", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(BENCH), *argv],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text(encoding="utf-8"))
    hops = document["sections"]["hops"]["rows"]
    assert [row["frame_bytes"] for row in hops] == [32, 16 << 20]
    assert all(row["local_us"] > 0 and row["ray_us"] > 0 for row in hops)
    throughput = document["sections"]["throughput"]
    assert [row["placement"] for row in throughput["rows"]] == ["local", "local_one_core", "ray"]
    memory = throughput["memory"]
    assert set(memory["stage_peak_rss_bytes"]) == {"stage-0", "stage-1"}
    assert all(size > 0 for size in memory["stage_peak_rss_bytes"].values())
    assert memory["ray_processes_total_bytes"] > 0  # Ray's own processes, reported apart
    [goal] = document["goals"]
    assert (goal["section"], goal["target"]) == ("throughput", ">= 1.6")
    assert goal["met"] == (throughput["ray_over_local"] >= 1.6)
    after = set(temp.glob("bp-ray-*")) | set(temp.glob("bench-placement-*"))
    assert after <= before  # the child's Ray files and the section's outputs are removed
