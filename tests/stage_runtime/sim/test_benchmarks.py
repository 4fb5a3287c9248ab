"""benchmarks/run.py runs bench_replay end to end (a tiny trace: a smoke test, nothing timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmark_scripts import load_script

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
    # The architecture's own floor: the same trio messages without cache work.
    assert result["message_floor_s"] > 0
    assert result["ratio_to_message_floor"] == result["wall_s"] / result["message_floor_s"]
    # The design's floor: the least messaging it needs (bare trio) plus the hashing floor.
    assert len(result["bare_message_floor_s_all"]) == 1
    assert result["bare_message_floor_s"] > 0
    assert result["bare_message_floor_s"] == min(result["bare_message_floor_s_all"])
    assert result["design_floor_ratio"] == pytest.approx(
        (result["floor_s"] + result["bare_message_floor_s"]) / result["floor_s"]
    )
    floor_cpu, bare_cpu = result["floor_cpu_s"], result["bare_message_floor_cpu_s"]
    budget_s = max(6 * floor_cpu - floor_cpu - bare_cpu, 0) / (2 * 4)
    assert result["goal_budget_cpu_us_per_stage_request"] == pytest.approx(budget_s * 1e6)
    assert "design floor / floor" in done.stdout
    assert result["machine"]["trio"]
    assert "replay" in done.stdout
    # Goals are reported with a verdict each, missed ones by name in the combined JSON.
    names = [goal["name"] for goal in result["goals"]]
    assert names == ["replay CPU time / hashing floor CPU time (ladder)", "peak RSS (MiB)"]
    assert all(isinstance(goal["met"], bool) for goal in result["goals"])
    assert result["goals"][1]["met"] is True  # two tiny requests are far under 2 GiB
    verdicts = {goal["name"]: goal["met"] for goal in result["goals"]}
    missed = {f"replay: {name}" for name, met in verdicts.items() if not met}
    # The paged index runs too, as its own entry, with the command line's peak RSS.
    paged = document["benchmarks"]["replay_paged"]
    assert paged["status"] == "ok", paged
    assert paged["result"]["index"] == "paged"
    assert paged["result"]["prompt_tokens"] == 1600
    assert 0 < paged["result"]["cli_peak_rss_bytes"] < 2**31
    paged_names = [goal["name"] for goal in paged["result"]["goals"]]
    assert paged_names == [
        "replay CPU time / hashing floor CPU time (paged)",
        "peak RSS (MiB)",
        "peak RSS of stage-runtime replay --index paged (MiB)",
    ]
    paged_verdicts = {goal["name"]: goal["met"] for goal in paged["result"]["goals"]}
    missed |= {f"replay_paged: {name}" for name, met in paged_verdicts.items() if not met}
    assert set(document["goals_missed"]) == missed
    assert document["goals_met"] == len(verdicts) + len(paged_verdicts) - len(missed)
    assert f"{len(verdicts) + len(paged_verdicts) - len(missed)} of 5 goals met" in done.stdout


def _run_module() -> ModuleType:
    return load_script("run")


def test_goal_rows_say_met_or_missed() -> None:
    goal_rows = _run_module().goal_rows
    result = {
        "goals": [
            {"name": "fast", "target": "< 2", "measured": 1.2, "met": True},
            {"name": "small", "target": "< 1 GB", "measured": 3, "met": False},
            {"name": "unsure", "target": "?", "measured": None},  # no verdict is not a pass
        ]
    }
    assert goal_rows("x", result) == [
        ("x", "fast", "< 2", "1.2", "MET"),
        ("x", "small", "< 1 GB", "3", "MISSED"),
        ("x", "unsure", "?", "None", "MISSED"),
    ]
    assert goal_rows("x", {"wall_s": 1.0}) == []
    # bench_paged's form: keyed by name, measured per capacity, a stretch goal, one not run.
    keyed = {
        "goals": {
            "wall": {
                "required": True,
                "target": "<= 1.5",
                "per_capacity": {
                    "1000000": {"paged_over_ladder": 2.05, "met": False},
                    "0": {"paged_over_ladder": 0.9, "met": True},
                },
                "met": False,
            },
            "stretch": {"required": False, "target": "beat LRU", "measured": 0.324, "met": True},
            "bounded": {"required": True, "target": ">= LRU", "per_capacity": {}, "met": None},
        }
    }
    assert goal_rows("p", keyed) == [
        ("p", "wall", "<= 1.5", "1000000: 2.05 (missed), unbounded: 0.9", "MISSED"),
        ("p", "stretch (stretch)", "beat LRU", "0.324", "MET"),
        ("p", "bounded", ">= LRU", "", "NOT RUN"),
    ]
    assert goal_rows("x", ["not", "a", "dict"]) == []
