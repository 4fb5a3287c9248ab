"""The benchmark scripts refuse bad arguments in one line (exit 2) before measuring anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmark_scripts import load_script


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        (
            "run",
            ["--only", "bogus"],
            "--only must name benchmarks among actors, cache, clairvoyant, http, identity",
        ),
        ("run", ["--trace", "/no/such/trace.jsonl"], "cannot read trace /no/such/trace.jsonl"),
        ("bench_replay", ["/no/such/trace.jsonl"], "cannot read trace /no/such/trace.jsonl"),
        ("bench_paged", ["--trace", "/no/such.jsonl"], "cannot read trace /no/such.jsonl"),
        ("bench_replay", ["TRACE", "--repeat", "0"], "--repeat: must be an integer >= 1, got 0"),
        ("bench_replay", ["TRACE", "--limit-requests", "-1"], "--limit-requests: must be an"),
        ("bench_identity", ["--repeat", "0"], "--repeat: must be an integer >= 1, got 0"),
        ("bench_actors", ["--reps", "0"], "--reps: must be an integer >= 1, got 0"),
        ("bench_llama", ["--layers", "0"], "--layers: must be an integer >= 1, got 0"),
        ("bench_llama", ["--tokens", "10", "--cached", "10"], "--cached must be below --tokens"),
        ("bench_http", ["--requests", "0"], "--requests: must be an integer >= 1, got 0"),
        ("bench_http", ["--concurrency", "1", "0"], "--concurrency: must be an integer >= 1"),
        ("bench_http", ["--load-requests", "-1"], "--load-requests: must be an integer >= 0"),
        ("bench_http", ["--log-level", "loud"], "--log-level: invalid choice: 'loud'"),
        ("bench_http", ["--width", "9000"], "--width: must be an integer in [1, 8,192], got 9000"),
        (
            "bench_clairvoyant",
            ["TRACE", "--block-size", "2"],
            "--block-size: must be an integer in [4, 1,048,576], got 2",
        ),
        ("bench_placement", ["/no/such/trace.jsonl"], "cannot read trace /no/such/trace.jsonl"),
        ("bench_placement", ["TRACE", "--repeat", "0"], "--repeat: must be an integer >= 1, got 0"),
        (
            "bench_placement",
            ["TRACE", "--workers", "1"],
            "--workers: must be an integer >= 2, got 1",
        ),
        (
            "bench_placement",
            ["TRACE", "--sections", "bogus"],
            "--sections: must name sections among replay, hops, throughput, got 'bogus'",
        ),
        ("bench_placement", ["TRACE", "--capacities", "5,-1"], "--capacities: must be a comma"),
        ("bench_clairvoyant", ["/no/such/trace.jsonl"], "cannot read trace /no/such/trace.jsonl"),
        ("bench_clairvoyant", ["TRACE", "--capacities", "1,x"], "--capacities: must be a comma"),
        ("bench_trace_parse", ["--repeat", "0"], "--repeat: must be an integer >= 1, got 0"),
        ("bench_trace_parse", ["/no/such.jsonl"], "cannot read trace /no/such.jsonl"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_and_write_nothing(
    script: str,
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A missing trace, an unknown benchmark or a zero repeat count used to run anyway
    (run.py overwrote results.json with nothing) or end in a traceback."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("", encoding="utf-8")
    argv = [str(trace) if arg == "TRACE" else arg for arg in argv]
    output = ["--output", str(tmp_path / "results.json")] if script == "run" else []
    output += ["--out-dir", str(tmp_path / "out")] if script == "run" else []
    if script != "run":
        output = ["--json", str(tmp_path / "out.json")]
    with pytest.raises(SystemExit) as caught:
        load_script(script).main([*argv, *output])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert ": error: " in err.strip().splitlines()[-1]  # argparse names the program first
    assert list(tmp_path.iterdir()) == [trace]
