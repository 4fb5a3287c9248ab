"""bench_cache feeds each stage's cache the calls the stage would make (checked against a replay)
and reports its figures and goals; nothing here is timed."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from actors.testing import capture_actor_logs
from stage_runtime.sim import SimConfig, SimRequest, read_demo_trace, run_replay
from tests.benchmark_scripts import load_script

bench = load_script("bench_cache")

TINY = [
    {"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 4]},
    {"timestamp": 2, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 3]},
]


def _tiny_trace(tmp_path: Path) -> Path:
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in TINY) + "\n", encoding="utf-8")
    return trace


@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_the_caches_restore_and_record_what_a_replay_s_stages_do(index: str) -> None:
    """Fed outside trio, each stage's cache hits, restores and records exactly as the stages of
    a replay of the same requests: the benchmark times the calls the pipeline makes."""
    requests: list[SimRequest] = list(read_demo_trace(limit=40).requests)
    config = SimConfig(stages=2, index=index)
    run = bench.run_once(requests, config)
    with capture_actor_logs():  # (quiet: every record and restore is a debug event)
        replayed = run_replay(requests, config)
    assert run.hits == [stage.hits for stage in replayed.stages]
    assert run.restored_tokens == [stage.restored_tokens for stage in replayed.stages]
    assert run.records == [stage.records for stage in replayed.stages]
    assert sum(run.hits) > 0
    assert run.restore_s > 0
    assert run.record_s > 0


def test_main_reports_us_per_stage_request_per_index_with_goals_and_a_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The JSON holds one figure per index, the issue's two goals with a verdict each, the
    repetitions behind each median, and with --profile the top functions of each index."""
    out = tmp_path / "out" / "cache.json"
    argv = [str(_tiny_trace(tmp_path)), "--repeat", "2", "--profile", "--profile-top", "5"]
    result = bench.main([*argv, "--json", str(out)])
    assert json.loads(out.read_text(encoding="utf-8")) == result
    assert result["requests"] == 3
    assert result["prompt_tokens"] == 4100
    assert set(result["us_per_stage_request"]) == {"ladder", "paged"}
    for index, row in result["indexes"].items():
        assert row["us_per_stage_request"] == result["us_per_stage_request"][index]
        assert len(row["us_per_stage_request_all"]) == 2
        assert row["us_per_stage_request"] == pytest.approx(
            sorted(row["us_per_stage_request_all"])[0] / 2
            + sorted(row["us_per_stage_request_all"])[1] / 2
        )
        assert row["us_per_stage_request_gc_off"] > 0  # one more run, the collector off
        assert row["hits"] == [2, 2, 2, 2]  # requests 1 and 2 share a prefix with request 0
        assert row["config"]["capacity_tokens"] == 0  # the command line's default
        assert 1 <= len(row["profile"]) <= 5
        assert {"function", "ncalls", "tottime_s", "cumtime_s"} <= set(row["profile"][0])
    assert [(goal["name"], goal["target"]) for goal in result["goals"]] == [
        ("ladder: cache work per stage and request (us)", "<= 30"),
        ("paged: cache work per stage and request (us)", "<= 60"),
    ]
    assert all(isinstance(goal["met"], bool) for goal in result["goals"])
    assert gc.isenabled()  # on again after the run without it
    printed = capsys.readouterr().out
    assert "us/stage-request" in printed
    assert "without gc" in printed
    assert "cProfile of the ladder index's restore and record calls" in printed
    assert "cProfile of the paged index's restore and record calls" in printed


def test_one_index_is_measured_alone(tmp_path: Path) -> None:
    """--index paged measures (and sets a goal for) the paged index only."""
    out = tmp_path / "cache.json"
    argv = [str(_tiny_trace(tmp_path)), "--index", "paged", "--repeat", "1"]
    result = bench.main([*argv, "--json", str(out)])
    assert list(result["us_per_stage_request"]) == ["paged"]
    assert [goal["target"] for goal in result["goals"]] == ["<= 60"]
    assert "profile" not in result["indexes"]["paged"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["/no/such/trace.jsonl"], "cannot read trace /no/such/trace.jsonl"),
        ([], "a trace path is required"),
        (["TRACE", "--repeat", "0"], "--repeat: must be an integer >= 1, got 0"),
        (["TRACE", "--index", "bogus"], "--index: invalid choice: 'bogus'"),
        (["TRACE", "--profile-top", "0"], "--profile-top: must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_and_write_nothing(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Usage errors end before anything is measured or written."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("", encoding="utf-8")
    argv = [str(trace) if arg == "TRACE" else arg for arg in argv]
    with pytest.raises(SystemExit) as caught:
        bench.main([*argv, "--json", str(tmp_path / "out.json")])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert list(tmp_path.iterdir()) == [trace]
