"""bench_replay measures either index against its CPU-time goal (a tiny trace: nothing timed).

The script runs in a fresh process: it configures structlog to cache its loggers, which would
outlive it here and hide log events from later tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_script


def _run(tmp_path: Path, *argv: str) -> tuple[dict[str, object], str]:
    trace = tmp_path / "tiny.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 900, "output_length": 1, "hash_ids": [1, 2]},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    out = tmp_path / "out" / "replay.json"
    script = BENCHMARKS / "bench_replay.py"
    done = subprocess.run(
        [sys.executable, str(script), str(trace), "--json", str(out), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(out.read_text(encoding="utf-8"))
    return result, done.stdout


@pytest.mark.parametrize(("index", "goal"), [("ladder", 6), ("paged", 8)])
def test_the_cpu_time_ratio_to_the_floor_is_the_goal_of_either_index(
    index: str, goal: int, tmp_path: Path
) -> None:
    """--index picks the cache; its goal is the replay's CPU time over the hashing floor's
    (6x with the ladder, 8x with pages), next to the peak RSS goal; the wall-time figures stay."""
    result, printed = _run(tmp_path, "--index", index, "--repeat", "2")
    assert result["index"] == index
    config = result["config"]
    assert isinstance(config, dict)
    assert config["index"] == index
    assert config["capacity_tokens"] == 0  # the command line's defaults
    cpu, floor_cpu = result["cpu_s"], result["floor_cpu_s"]
    assert isinstance(cpu, float)
    assert isinstance(floor_cpu, float)
    assert floor_cpu > 0
    assert result["ratio_to_floor_cpu"] == cpu / floor_cpu
    goals = result["goals"]
    assert isinstance(goals, list)
    cli_goal = [(f"peak RSS of stage-runtime replay --index {index} (MiB)", "<= 400")]
    assert [(g["name"], g["target"]) for g in goals] == [
        (f"replay CPU time / hashing floor CPU time ({index})", f"<= {goal}"),
        ("peak RSS (MiB)", "< 2048"),
        *(cli_goal if index == "paged" else []),
    ]
    # The paged index's goal on the command line's own peak RSS: the replay run as a user would.
    cli_peak = result["cli_peak_rss_bytes"]
    if index == "paged":
        assert isinstance(cli_peak, int)
        assert goals[2]["measured"] == round(cli_peak / 2**20)
        assert goals[2]["met"] is (cli_peak <= 400 * 2**20)
        assert "peak RSS of the CLI's replay" in printed
    else:
        assert cli_peak is None
    assert goals[0]["measured"] == round(cpu / floor_cpu, 2)
    assert goals[0]["met"] is (cpu / floor_cpu <= goal)
    assert result["goal"] == {"ratio_to_floor_cpu_max": goal, "peak_rss_bytes_max": 2 * 1024**3}
    # The design floor in CPU time: the fastest bare-trio messaging plus the hashing floor.
    bare = result["bare_message_floor_cpu_s_all"]
    assert isinstance(bare, list)
    assert len(bare) == 2
    assert result["bare_message_floor_cpu_s"] == min(bare)
    assert result["design_floor_ratio_cpu"] == pytest.approx((floor_cpu + min(bare)) / floor_cpu)
    budget = max(goal * floor_cpu - floor_cpu - min(bare), 0) / (2 * 4) * 1e6
    assert result["goal_budget_cpu_us_per_stage_request"] == pytest.approx(budget)
    beyond = max(cpu - floor_cpu - min(bare), 0) / (2 * 4) * 1e6
    assert result["beyond_design_floor_cpu_us_per_stage_request"] == pytest.approx(beyond)
    # The same replay with caches that do nothing, once per repeat.
    null = result["null_cache_cpu_s_all"]
    assert isinstance(null, list)
    assert len(null) == 2
    assert result["null_cache_cpu_s"] == pytest.approx(sum(null) / 2)
    assert result["null_cache_ratio_to_floor_cpu"] == pytest.approx(sum(null) / 2 / floor_cpu)
    assert result["cache_share_cpu"] == pytest.approx((cpu - sum(null) / 2) / cpu)
    assert "caches doing nothing (CPU)" in printed
    # The other figures are still there.
    for key in ("wall_s", "floor_s", "ratio_to_floor", "message_floor_s", "design_floor_ratio"):
        assert key in result
    assert f"{index} index" in printed
    assert f"(goal <= {goal}x)" in printed


def test_an_unknown_index_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--index takes the two indexes only, and refuses anything else before measuring."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("", encoding="utf-8")
    with pytest.raises(SystemExit) as caught:
        load_script("bench_replay").main(
            [str(trace), "--index", "bogus", "--json", str(tmp_path / "out.json")]
        )
    assert caught.value.code == 2
    assert "--index: invalid choice: 'bogus'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [trace]


def test_caches_doing_nothing_restore_and_record_nothing_until_the_block_ends() -> None:
    """Within the block every stage cache misses and stores nothing (the replay restores 0%);
    afterwards the real methods are back, and the same replay restores again."""
    from stage_runtime.cache.stage_cache import StageCache
    from stage_runtime.sim import SimConfig, read_demo_trace, run_replay

    bench = load_script("bench_replay")
    requests = list(read_demo_trace().requests)[:40]
    config = SimConfig(stages=2)
    restore, record = StageCache.restore_prompt, StageCache.record_prompt
    with bench._caches_doing_nothing():
        nothing = run_replay(requests, config)
    assert (StageCache.restore_prompt, StageCache.record_prompt) == (restore, record)
    assert nothing.token_hit_ratio == 0
    assert all(
        stage.accounting is None or stage.accounting.entries == 0 for stage in nothing.stages
    )
    assert run_replay(requests, config).token_hit_ratio > 0
