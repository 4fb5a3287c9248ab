"""The command line: exit codes, one-line errors, JSON on stdout, the demo.

Usage errors are checked in-process (they stop before any replay); full runs go through a
subprocess, as a user would run them, and are kept few and small.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import structlog.testing

from stage_runtime.cli import build_parser, main

TINY = [
    {"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 5, "input_length": 32, "output_length": 1, "hash_ids": [7, 8]},
    {"timestamp": 9, "input_length": 40, "output_length": 1, "hash_ids": [1, 2, 4]},
]
SMALL = ["--block-size", "16", "--bytes-per-token", "2", "--stages", "2"]


def _run(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stage_runtime", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        check=False,
    )


def _trace(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["replay", "t.jsonl", "--bogus"], "unrecognized arguments: --bogus"),
        (
            ["demo", "--capacity-tokens", "-1"],
            "argument --capacity-tokens: must be an integer >= 0, got -1",
        ),
        (
            ["demo", "--stages", "two"],
            "argument --stages: must be an integer in [1, 256], got 'two'",
        ),
        (["demo", "--stages", "257"], "argument --stages: must be an integer in [1, 256], got 257"),
        (
            ["demo", "--block-size", "3"],  # smaller blocks could make distinct ids collide
            "argument --block-size: must be an integer in [4, 1,048,576], got 3",
        ),
        (
            ["demo", "--prefill-us-per-token", "1e308"],
            "every cost must be at most 3.6e+09 (an hour), got 1e308",
        ),
        (
            ["demo", "--restore-ns-per-byte", "1e300"],
            "argument --restore-ns-per-byte: must be at most 3.6e+12 (an hour), got 1e300",
        ),
        (["demo", "--concurrency", "0"], "argument --concurrency: must be an integer >= 1, got 0"),
        (["simulate", "--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
        (["simulate", "--rate", "0"], "argument --rate: must be a finite number > 0, got 0"),
        (["simulate", "--rate", "-1"], "argument --rate: must be a finite number > 0, got -1"),
        (["simulate", "--rate", "inf"], "argument --rate: must be a finite number > 0, got inf"),
        (["demo", "--stride", "0"], "--stride 0 leaves no lookup grid for --record-limit 2"),
        (["demo", "--capacity-tokens", "5", "--sweep-capacity", "1,2"], "are exclusive"),
        (["demo", "--sweep-capacity", "1,,2"], "comma-separated list"),
        (["demo", "--plot", "-"], "--plot takes a file (.png, .svg or .pdf), not - (stdout)"),
        (["demo", "--sweep-capacity", "8,-5"], "every capacity must be an integer >= 0, got -5"),
        # A list starting with a minus sign is the list's error, not argparse's "expected one
        # argument" (it took "-1,5" for an option).
        (["demo", "--sweep-capacity", "-1,5"], "every capacity must be an integer >= 0, got -1"),
        (["demo", "--prefill-us-per-token", "-1,2"], "every cost must be a finite number >= 0"),
        (["demo", "--prefill-us-per-token", "-3"], "every cost must be a finite number >= 0"),
        (["demo", "--prefill-us-per-token", "1,2"], "one cost or one per stage (4), got 2"),
        (["simulate", "--groups", "0", "--conversations", "0"], "the workload has no requests"),
        (
            ["demo", "--block-size", "2000000000"],
            "argument --block-size: must be an integer in [4, 1,048,576], got 2000000000",
        ),
        (
            ["demo", "--bytes-per-token", "99999999999999999999999"],
            "argument --bytes-per-token: must be an integer in [1, 16,777,216], got "
            "99999999999999999999999",
        ),
        (
            ["demo", "--capacity-tokens", "99999999999999999999"],
            "--capacity-tokens 99,999,999,999,999,999,999 x --bytes-per-token 8,192 is "
            "819,199,999,999,999,999,991,808 bytes, more than a cache's byte bound allows",
        ),
        (
            ["demo", "--sweep-capacity", "0,3000000000000000", "--bytes-per-token", "8192"],
            "--sweep-capacity 3,000,000,000,000,000 x --bytes-per-token 8,192",
        ),
        (
            ["simulate", "--system-prompt-tokens", "1000000000"],
            "--system-prompt-tokens 1,000,000,000 + --question-tokens 384 make prompts longer "
            "than the stages' context (262,144 tokens)",
        ),
        (
            ["simulate", "--turns", "5000"],
            "--turns 5,000 x --tokens-per-turn 512 make the last turn longer than the stages' "
            "context (262,144 tokens)",
        ),
        (
            ["demo", "--block-size", "256"],
            "--block-size 256 is smaller than the bundled excerpt's 512-token blocks; the demo "
            "needs --block-size >= 512",
        ),
        (
            ["demo", "--page-tokens", "64", "--page-eviction", "reuse"],
            "--page-tokens and --page-eviction apply to --index paged only (got --index ladder)",
        ),
        (
            ["demo", "--page-eviction", "reuse"],
            "--page-eviction applies to --index paged only (got --index ladder)",
        ),
        (
            ["demo", "--index", "paged", "--page-tokens", "99999999999999999999"],
            "argument --page-tokens: must be an integer in [1, 18,446,744,073,709,551,615], got ",
        ),
        (
            ["demo", "--max-entries", "99999999999999999999999"],
            "argument --max-entries: must be an integer in [1, 18,446,744,073,709,551,615], got ",
        ),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
        (
            ["replay", "t.jsonl", "--workers", "0"],
            "argument --workers: must be an integer >= 1, got 0",
        ),
        (["simulate", "--workers", "-2"], "argument --workers: must be an integer >= 1, got -2"),
        (["demo", "--workers", "two"], "argument --workers: must be an integer >= 1, got 'two'"),
        (["demo", "--workers", "1.5"], "argument --workers: must be an integer >= 1, got '1.5'"),
        (["simulate", "--placement", "cloud"], "argument --placement: invalid choice: 'cloud'"),
        (
            ["replay", "t.jsonl", "--placement", "local", "--ray-address", "auto"],
            "--ray-address auto needs --placement ray, got --placement local",
        ),
        (
            ["simulate", "--ray-address", ""],
            "argument --ray-address: must be a Ray address ('auto', 'host:port' or "
            "'ray://host:port'), got ''",
        ),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Unknown flags and impossible settings: exit code 2 and a single line on stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert fragment in captured.err
    assert captured.err.startswith("stage-runtime")


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "t.jsonl", "--placement", "ray"],
        ["simulate", "--ray-address", "auto"],  # an address means Ray too
    ],
)
def test_ray_placement_without_ray_names_the_extra(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without Ray installed, --placement ray is one line naming the extra, exit 2, before
    anything is read or replayed."""
    import stage_runtime.placement

    monkeypatch.setattr(stage_runtime.placement, "ray_available", lambda: False)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"stage-runtime {argv[0]}: error: ")
    assert "pip install 'stage-runtime[ray]'" in captured.err


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    """--version prints the program name and the distribution's version, exit 0."""
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert (
        capsys.readouterr().out == f"stage-runtime {importlib.metadata.version('stage-runtime')}\n"
    )


@pytest.mark.parametrize(
    ("flag", "what"), [("--json", "JSON"), ("--plot", "plot")], ids=["json", "plot"]
)
def test_unwritable_output_is_refused_before_replaying(
    flag: str, what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An output in a missing directory fails at once (exit 1), naming the operation and path."""
    target = tmp_path / "missing" / "out"
    with structlog.testing.capture_logs() as logs:
        code = main(["demo", flag, str(target)])
    assert code == 1
    err = capsys.readouterr().err
    assert err == (
        f"stage-runtime demo: error: cannot write {what} to {target}: "
        f"directory {target.parent} does not exist\n"
    )
    assert logs == []  # nothing ran: no pipeline started


def test_an_output_on_a_read_only_file_system_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only mount was reported as "permission denied", which sent users to chmod."""
    folder = tmp_path / "mounted"
    folder.mkdir()
    access, statvfs = os.access, os.statvfs

    def read_only_access(path: object, mode: int, **kwargs: object) -> bool:
        return False if Path(str(path)) == folder else access(path, mode, **kwargs)  # type: ignore[arg-type]

    def read_only_statvfs(path: object) -> object:
        if Path(str(path)) == folder:
            return type("StatVfs", (), {"f_flag": os.ST_RDONLY})()
        return statvfs(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", read_only_access)
    monkeypatch.setattr(os, "statvfs", read_only_statvfs)
    assert main(["demo", "--json", str(folder / "out.json")]) == 1
    assert capsys.readouterr().err == (
        f"stage-runtime demo: error: cannot write JSON to {folder / 'out.json'}: "
        "read-only file system\n"
    )


def test_missing_trace_is_named_as_a_trace_that_cannot_be_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing trace file exits 1 with what could not be done and why."""
    missing = tmp_path / "nope.jsonl"
    assert main(["replay", str(missing)]) == 1
    assert capsys.readouterr().err == (
        f"stage-runtime replay: error: cannot read trace {missing}: no such file\n"
    )


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    """main() configures structlog like a program does; put the test's configuration back
    (for every test here: a replay run in-process would leave later tests' log capture off)."""
    saved = structlog.get_config()
    yield
    structlog.reset_defaults()
    structlog.configure(**saved)


@pytest.mark.parametrize(
    ("flags", "shown", "hidden"),
    [
        ([], [], ["activation_evicted", "activation_recorded"]),
        (["-v"], ["activation_evicted", "stage_started"], ["activation_recorded"]),
        (["-vv"], ["activation_evicted", "activation_recorded", "activation_missed"], []),
    ],
    ids=["quiet", "v", "vv"],
)
def test_verbosity_flags_log_what_their_help_says(
    flags: list[str],
    shown: list[str],
    hidden: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """-v logs lifecycle and evictions (info); -vv adds every record and miss (debug)."""
    trace = _trace(tmp_path, [json.dumps(line) for line in TINY])
    argv = ["replay", str(trace), *SMALL, "--capacity-tokens", "20", "--json", "-", *flags]
    assert main(argv) == 0
    err = capsys.readouterr().err
    for event in shown:
        assert event in err
    for event in hidden:
        assert event not in err


def test_serve_without_the_server_module_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """If stage_runtime.server is not installed, serve says so and exits 2."""
    monkeypatch.setitem(sys.modules, "stage_runtime.server.command", None)
    monkeypatch.setitem(sys.modules, "stage_runtime.server", None)
    assert main(["serve", "--topology", "pipeline.toml"]) == 2
    assert "server" in capsys.readouterr().err


def test_demo_prints_a_report_and_writes_json(tmp_path: Path) -> None:
    """The README's first command: 300 requests, 4 stages, a readable report, exit 0."""
    done = _run("demo", "--json", "demo.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for fragment in ("token hit ratio", "theoretical max", "stage-3", "p99", "tokens/s"):
        assert fragment in done.stdout
    document = json.loads((tmp_path / "demo.json").read_text(encoding="utf-8"))
    assert document["requests"] == 300
    assert 0 < document["token_hit_ratio"] <= document["theoretical_max_hit_ratio"]
    assert document["config"]["stages"] == 4
    before, _, theoretical = _documented_demo_figures()  # what the docs say the demo prints
    assert f"token hit ratio {before:.1f}%" in " ".join(done.stdout.split())
    assert round(100 * document["theoretical_max_hit_ratio"], 1) == theoretical


def test_replay_sweep_json_to_stdout_is_pure_json(tmp_path: Path) -> None:
    """--json - with a sweep: stdout is exactly one JSON list, one result per capacity."""
    trace = _trace(tmp_path, [json.dumps(line) for line in TINY])
    done = _run(
        "replay", str(trace), *SMALL, "--sweep-capacity", "32,0", "--json", "-", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert [r["config"]["capacity_tokens"] for r in results] == [32, 0]
    assert [r["restored_tokens"] for r in results] == [0, 32]
    assert results[0]["stages"][0]["evictions"] == 5


def test_simultaneous_arrivals_give_a_queueing_share_but_no_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two lines with one timestamp at --concurrency 2: offered_load is null (no arrival
    rate), ttft_waiting_share is the second request's wait over both TTFTs, and the report
    shows the share."""
    same = [dict(TINY[0], timestamp=7), dict(TINY[1], timestamp=7)]
    trace = _trace(tmp_path, [json.dumps(line) for line in same])
    argv = ["replay", str(trace), *SMALL, "--concurrency", "2", "--prefill-us-per-token", "1000"]
    assert main([*argv, "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["arrival_span_s"] == 0
    assert document["offered_load"] is None
    # 40 and 32 tokens at 1 ms per token and stage: r0 takes 40 + 40 ms, r1 waits 40 ms for
    # stage 0 then 8 ms for stage 1 (free at 80 ms): 48 of the 80 + 112 ms are queueing.
    assert document["ttft_waiting_share"] == pytest.approx(48 / 192)
    assert main(argv) == 0
    assert "share of all TTFT spent queueing" in capsys.readouterr().out


def test_arrivals_spanning_more_than_1e9_s_replay_one_at_a_time_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Timestamps 2e12 ms (2e9 s) apart: --concurrency 1 replays them in file order (they are
    not used); --concurrency 2, paced by them, is refused in one line, as the docs say."""
    far = [TINY[0], dict(TINY[2], timestamp=2 * 10**12)]
    trace = _trace(tmp_path, [json.dumps(line) for line in far])
    assert main(["replay", str(trace), *SMALL, "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["arrival_span_s"] == 2e9
    assert document["restored_tokens"] == 32
    status = main(["replay", str(trace), *SMALL, "--concurrency", "2", "--json", "-"])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    assert captured.err.endswith(
        "arrivals must span at most 1e+09 s (about 31 years) at concurrency > 1, got 2e+09 s, "
        "from request 0 (line 1) to request 1 (line 2)\n"
    )


def test_bad_trace_line_exits_1_naming_file_line_and_field(tmp_path: Path) -> None:
    """A malformed line stops the replay with exit 1 and file:line: field in one line."""
    bad = dict(TINY[0], input_length=-4)
    trace = _trace(tmp_path, [json.dumps(TINY[0]), json.dumps(bad), json.dumps(TINY[2])])
    done = _run("replay", str(trace), *SMALL, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1
    assert f"{trace}:2: input_length must be >= 1, got -4" in done.stderr

    skipped = _run("replay", str(trace), *SMALL, "--skip-bad-lines", "--json", "-", cwd=tmp_path)
    assert skipped.returncode == 0, skipped.stderr
    document = json.loads(skipped.stdout)
    assert document["requests"] == 2
    assert document["skipped_lines"] == 1
    assert document["config"]["source"]["skipped_lines"] == 1


def test_simulate_writes_a_plot_and_a_report(tmp_path: Path) -> None:
    """simulate with a small workload prints its report and writes the PNG."""
    done = _run(
        "simulate",
        "--groups",
        "2",
        "--prompts-per-group",
        "3",
        "--conversations",
        "1",
        "--turns",
        "3",
        "--plot",
        "plot.png",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "9 synthetic requests" in done.stdout
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_serve_without_the_server_extra_names_the_missing_package(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without hypercorn, serve exits 2 with a one-line install hint, before any stage starts."""
    monkeypatch.setitem(sys.modules, "hypercorn", None)
    topology = Path(__file__).resolve().parents[2] / "examples" / "topology.toml"
    assert main(["serve", "--topology", str(topology)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "stage-runtime serve: error: the server needs the 'server' extra (hypercorn is "
        "missing): pip install 'stage-runtime[server]'"
    ]


def test_plot_without_matplotlib_is_refused_before_replaying(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot without the plot extra (or with a broken one) exits 2 at once, naming the extra
    to install."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it fails
    assert main(["demo", "--plot", "out.png"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'stage-runtime[plot]'" in err
    assert "ModuleNotFoundError" in err
    assert err.count("\n") == 1


def test_json_and_plot_to_the_same_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plot would silently replace the JSON: refused before replaying."""
    target = tmp_path / "out.png"
    assert main(["demo", "--json", str(target), "--plot", str(target)]) == 2
    assert "--json and --plot name the same file" in capsys.readouterr().err
    assert not target.exists()
    target.write_text("{}")  # through a link too
    link = tmp_path / "link.png"
    link.symlink_to(target)
    assert main(["demo", "--json", str(target), "--plot", str(link)]) == 2
    assert "--json and --plot name the same file" in capsys.readouterr().err
    assert target.read_text() == "{}"


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_output_naming_the_trace_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """`replay t.jsonl --json t.jsonl` replaced the user's trace with the results (exit 0); a
    link to it too. Refused before replaying, and the trace is untouched."""
    trace = _trace(tmp_path, [json.dumps(line) for line in TINY])
    before = trace.read_bytes()
    link = tmp_path / "results"
    link.symlink_to(trace)
    for target in (trace, link):
        assert main(["replay", str(trace), *SMALL, flag, str(target)]) == 2
        err = capsys.readouterr().err
        assert f"{flag} names the trace being replayed ({target}): it would replace it" in err
        assert err.count("\n") == 1
    assert trace.read_bytes() == before


def test_paths_and_bad_lines_are_printed_as_they_are(tmp_path: Path) -> None:
    """Brackets in a path or a quoted value were read as rich markup (a MarkupError traceback
    after the whole replay, or silently changed text), and ':warning:' became an emoji; non-ASCII
    text crashed an ASCII-only stdout."""
    folder = tmp_path / "d[" / "b]"  # the path reads "d[/b]": a closing tag
    folder.mkdir(parents=True)
    trace = folder / ":warning: tracé.jsonl"
    bad = {"timestamp": "[/x] [bold]oops", "input_length": 4, "output_length": 1, "hash_ids": [1]}
    trace.write_text("".join(json.dumps(line) + "\n" for line in [*TINY, bad]), encoding="utf-8")
    done = _run("replay", str(trace), *SMALL, "--skip-bad-lines", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"stage-runtime replay: {trace}\n" in done.stdout
    assert '"[/x] [bold]oops"' in done.stdout
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    ascii_run = subprocess.run(
        [sys.executable, "-m", "stage_runtime", "replay", str(trace), *SMALL, "--skip-bad-lines"],
        capture_output=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
        check=False,
    )
    assert ascii_run.returncode == 0, ascii_run.stderr
    assert b"trac\\xe9.jsonl" in ascii_run.stdout


def test_a_closed_standard_input_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        ["/bin/sh", "-c", 'exec "$0" -m stage_runtime replay - <&-', sys.executable],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stderr) == (
        1,
        "stage-runtime replay: error: cannot read trace -: standard input is closed\n",
    )


def test_unknown_and_abbreviated_flags_name_the_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An unknown flag is refused by the subcommand (its name in the message), and prefixes
    of flags are not accepted (--limit is not --limit-requests)."""
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--limit", "10"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        "stage-runtime demo: error: unrecognized arguments: --limit 10\n"
    )


def test_sweep_capacities_are_run_once_each_in_the_reports_order() -> None:
    """Duplicates are dropped and the JSON list follows the table: smallest first, 0 last."""
    args = build_parser().parse_args(["demo", "--sweep-capacity", "0,262144,65536,0"])
    assert args.sweep_capacity == [65536, 262144, 0]


def test_cli_limits_are_the_simulations() -> None:
    """The CLI and the simulation read one copy of each limit (stage_runtime.limits)."""
    from stage_runtime import limits, sim

    assert sim.MAX_BLOCK_SIZE is limits.MAX_BLOCK_SIZE
    assert sim.MAX_COST_S is limits.MAX_COST_S
    assert sim.workloads.MAX_REQUESTS is limits.MAX_REQUESTS
    assert sim.SimConfig().ctx_size == limits.SIM_CTX_SIZE


@pytest.mark.parametrize(
    ("lines", "skip", "reason"),
    [
        (["", "  "], False, "it has no request lines (empty or blank)"),
        (
            ["{", json.dumps(dict(TINY[0], hash_ids=[]))],
            True,
            "every line was bad (2 skipped; the first: {trace}:1: is not valid JSON",
        ),
    ],
    ids=["blank", "all-bad"],
)
def test_a_trace_without_requests_is_named_with_the_reason(
    lines: list[str], skip: bool, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing to replay: exit 1, one line naming the file and why (blank, or every line bad)."""
    trace = _trace(tmp_path, lines)
    argv = ["replay", str(trace), *SMALL] + (["--skip-bad-lines"] if skip else [])
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(
        f"stage-runtime replay: error: no requests to replay in {trace}: "
        + reason.format(trace=trace)
    )


def _documented_simulation_commands() -> dict[str, str]:
    """The simulation page's ``stage-runtime`` example lines: command -> its comment."""
    page = Path(__file__).resolve().parents[2] / "docs" / "simulation.md"
    section = page.read_text(encoding="utf-8")
    commands = {}
    for line in section.splitlines():
        if line.startswith("stage-runtime ") and "#" in line:
            command, comment = line.split("#", 1)
            commands[command.strip()] = comment.strip()
    return commands


def _documented_demo_figures() -> tuple[float, float, float]:
    """The docs' "30.5% -> 60.1% restored (max 62.9%)": default demo, bigger caches, theory."""
    comment = _documented_simulation_commands()[
        "stage-runtime demo --max-entries 512 --record-limit 4"
    ]
    match = re.fullmatch(r"([\d.]+)% -> ([\d.]+)% restored \(max ([\d.]+)%\)", comment)
    assert match is not None, comment
    before, after, theoretical = (float(group) for group in match.groups())
    return before, after, theoretical


def test_documented_demo_figures_are_what_the_command_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The docs' demo line with bigger caches restores what its comment says (the default
    demo's figure is checked by test_demo_prints_a_report_and_writes_json)."""
    _, after, theoretical = _documented_demo_figures()
    assert main(["demo", "--max-entries", "512", "--record-limit", "4", "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert round(100 * document["token_hit_ratio"], 1) == after
    assert round(100 * document["theoretical_max_hit_ratio"], 1) == theoretical


@pytest.mark.parametrize(
    ("terminal", "json_out", "bar"),
    [("1", False, True), ("1", True, False), ("0", False, False)],
    ids=["terminal", "terminal-json-stdout", "not-a-terminal"],
)
def test_progress_bar_shows_on_terminals_only_and_never_with_json_stdout(
    terminal: str,
    json_out: bool,
    bar: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The bar goes to stderr on a terminal; piped, or with --json -, there is none."""
    monkeypatch.setenv("TTY_COMPATIBLE", terminal)  # rich's switch for "this is a terminal"
    trace = _trace(tmp_path, [json.dumps(line) for line in TINY])
    argv = ["replay", str(trace), *SMALL] + (["--json", "-"] if json_out else [])
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert ("replaying" in captured.err) == bar
    assert (f"{len(TINY)}/{len(TINY)}" in captured.err) == bar
    if json_out:
        assert json.loads(captured.out)["requests"] == len(TINY)


def test_console_script_is_stage_runtime() -> None:
    """`stage-runtime` is installed as a console script running cli.main (through
    console_main, which makes its stderr pass on whole lines)."""
    scripts = importlib.metadata.entry_points(group="console_scripts")
    entry = {ep.name: ep.value for ep in scripts}["stage-runtime"]
    assert entry == "stage_runtime.cli:console_main"


def test_whole_lines_never_splices_two_threads_lines() -> None:
    """A thread's text waits for its newline, so a line another thread writes meanwhile goes
    out before it, whole; flush passes on an unfinished line; the wrapped stream's tty and
    file number show through."""
    import io
    import threading

    from stage_runtime._cli_support import WholeLines

    out = io.StringIO()
    stream = WholeLines(out)
    stream.write('{"event": "first"}')  # what print writes before its newline
    other = threading.Thread(target=lambda: stream.write('{"event": "other"}\n'))
    other.start()
    other.join()
    stream.write("\n")
    stream.write("two\nlines\nand a rest")
    assert out.getvalue() == '{"event": "other"}\n{"event": "first"}\ntwo\nlines\n'
    stream.flush()
    assert out.getvalue().endswith("lines\nand a rest")
    assert stream.isatty() is False
    with pytest.raises(io.UnsupportedOperation):
        stream.fileno()  # (a StringIO has none)


def test_every_flag_reaches_the_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each shared flag lands in the configuration the replay used (JSON config) and acts."""
    trace = _trace(tmp_path, [json.dumps(line) for line in TINY])
    argv = [
        "replay",
        str(trace),
        "--stages",
        "3",
        "--block-size",
        "16",
        "--min-tokens",
        "8",
        "--stride",
        "4",
        "--record-limit",
        "3",
        "--max-entries",
        "7",
        "--capacity-tokens",
        "100",
        "--bytes-per-token",
        "6",
        "--concurrency",
        "2",
        "--limit-requests",
        "2",
        "--prefill-us-per-token",
        "10,20,30",
        "--restore-ns-per-byte",
        "2",
        "--json",
        "-",
    ]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    config = document["config"]
    assert {
        key: config[key] for key in ("stages", "block_size", "min_tokens", "stride_tokens")
    } == {
        "stages": 3,
        "block_size": 16,
        "min_tokens": 8,
        "stride_tokens": 4,
    }
    assert (config["record_limit"], config["max_entries"], config["concurrency"]) == (3, 7, 2)
    assert (config["capacity_tokens"], config["bytes_per_token"], config["max_bytes"]) == (
        100,
        6,
        600,
    )
    assert config["prefill_s_per_token"] == pytest.approx([10e-6, 20e-6, 30e-6])
    assert config["restore_s_per_byte"] == pytest.approx(2e-9)
    assert config["source"]["limit_requests"] == 2
    assert document["requests"] == 2
    assert document["prompt_tokens"] == 40 + 32
    assert len(document["stages"]) == 3


def test_simulate_refuses_a_workload_past_the_limits_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--groups 100000000 is refused at once (exit 2), before anything is generated."""
    assert main(["simulate", "--groups", "100000000"]) == 2
    assert capsys.readouterr().err == (
        "stage-runtime simulate: error: the workload would have 1,200,000,048 requests; at most "
        "200,000 are generated (fewer --groups, --prompts-per-group, --conversations or "
        "--turns)\n"
    )


def test_simulate_flags_shape_the_workload(capsys: pytest.CaptureFixture[str]) -> None:
    """simulate's workload flags give that many requests of those lengths, and are reported."""
    argv = [
        "simulate",
        "--groups",
        "2",
        "--prompts-per-group",
        "3",
        "--system-prompt-tokens",
        "100",
        "--question-tokens",
        "20",
        "--conversations",
        "1",
        "--turns",
        "4",
        "--tokens-per-turn",
        "50",
        "--rate",
        "2",
        "--seed",
        "5",
        "--block-size",
        "16",
        "--json",
        "-",
    ]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["requests"] == 2 * 3 + 4
    assert document["prompt_tokens"] == 2 * 3 * (100 + 20) + 50 * (1 + 2 + 3 + 4)
    source = document["config"]["source"]
    assert (source["kind"], source["seed"], source["requests_per_s"]) == ("synthetic", 5, 2.0)


def test_bundled_excerpt_ships_with_its_attribution() -> None:
    """The demo's excerpt is package data, next to an attribution naming source and licence,
    and its stated size and sharing are the excerpt's."""
    from importlib import resources

    from stage_runtime.sim import read_demo_trace, theoretical_max_hit_ratio

    text = resources.files("stage_runtime.data").joinpath("ATTRIBUTION.md").read_text()
    attribution = " ".join(text.split())  # as one line: the file wraps at 100 columns
    for fragment in ("kvcache-ai/Mooncake", "Apache License 2.0", "300 requests", "62.9%"):
        assert fragment in attribution
    requests = read_demo_trace().requests
    assert len(requests) == 300
    assert f"{sum(r.input_length for r in requests):,} prompt tokens" in attribution
    ratio = theoretical_max_hit_ratio(requests, block_size=512).ratio
    assert f"{ratio:.1%}" == "62.9%"


def test_trace_from_standard_input(tmp_path: Path) -> None:
    """'-' reads the trace from standard input (zcat trace.gz | stage-runtime replay -), and a
    pipe given by path (/dev/stdin) is not refused as a missing file."""
    lines = "".join(json.dumps(line) + "\n" for line in TINY)
    for source in ("-", "/dev/stdin"):
        done = _run("replay", source, *SMALL, "--json", "-", cwd=tmp_path, stdin=lines)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["requests"] == 3
    bad = _run("replay", "-", *SMALL, cwd=tmp_path, stdin=lines + "{oops\n")
    assert bad.returncode == 1
    assert bad.stderr == "stage-runtime replay: error: <stdin>:4: is not valid JSON " + (
        "(expecting property name enclosed in double quotes at column 2)\n"
    )


def test_ctrl_c_during_a_replay_exits_130_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C reaches the command wrapped in trio's exception groups: still one line, 130."""
    from stage_runtime import sim

    def interrupted(*args: object, **kwargs: object) -> object:
        raise BaseExceptionGroup("nursery", [BaseExceptionGroup("stage", [KeyboardInterrupt()])])

    monkeypatch.setattr(sim, "run_replay", interrupted)
    trace = _trace(tmp_path, [json.dumps(line) for line in TINY])
    assert main(["replay", str(trace), *SMALL]) == 130
    assert capsys.readouterr().err == "stage-runtime replay: error: interrupted\n"

    def crashed(*args: object, **kwargs: object) -> object:
        raise BaseExceptionGroup("nursery", [KeyboardInterrupt(), RuntimeError("bug")])

    monkeypatch.setattr(sim, "run_replay", crashed)
    with pytest.raises(BaseExceptionGroup):  # an interrupt does not hide a real error
        main(["replay", str(trace), *SMALL])


def test_plot_format_follows_the_suffix_and_is_checked_before_replaying(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown suffix is refused at once (exit 2); no suffix writes a PNG at exactly the path."""
    with structlog.testing.capture_logs() as logs:
        assert main(["demo", "--plot", str(tmp_path / "plot.xyz")]) == 2
    assert capsys.readouterr().err == (
        f"stage-runtime demo: error: cannot write a plot to {tmp_path / 'plot.xyz'}: the suffix "
        "must be .png, .svg, .pdf (or none, for PNG), got .xyz\n"
    )
    assert logs == []
    trace = _trace(tmp_path, [json.dumps(line) for line in TINY])
    for name, magic in (("plot", b"\x89PNG"), ("plot.svg", b"<?xml")):
        assert main(["replay", str(trace), *SMALL, "--plot", str(tmp_path / name)]) == 0
        assert (tmp_path / name).read_bytes()[: len(magic)] == magic
        assert f"plot written to {tmp_path / name}" in capsys.readouterr().out
    assert not (tmp_path / "plot.png").exists()


def test_prompts_longer_than_the_stages_context_are_bad_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """replay refuses what simulate refuses: a prompt over the 262,144-token context."""
    long = {"timestamp": 0, "input_length": 300_000, "output_length": 1, "hash_ids": [9] * 600}
    trace = _trace(tmp_path, [json.dumps(TINY[0]), json.dumps(long)])
    assert main(["replay", str(trace)]) == 1
    assert capsys.readouterr().err == (
        f"stage-runtime replay: error: {trace}:2: input_length must be <= 262,144 (the stages' "
        "context), got 300,000\n"
    )
    assert main(["replay", str(trace), "--skip-bad-lines", "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["requests"], document["skipped_lines"]) == (1, 1)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_a_file_without_line_breaks_is_refused_at_its_first_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """/dev/zero (or a binary file) is no trace: one line naming the file, line 1 and the
    limit, exit 1, after reading no more than the limit (not the file until memory runs out)."""
    assert main(["replay", "/dev/zero"]) == 1
    assert capsys.readouterr().err == (
        "stage-runtime replay: error: /dev/zero:1: is longer than 67,108,864 bytes: a trace "
        "line holds one request (is this a JSON lines file?)\n"
    )


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_report_that_cannot_be_written_names_stdout(tmp_path: Path) -> None:
    """A full disk under stdout is one line saying what could not be written, exit code 1
    (it was the bare '[Errno 28] No space left on device')."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "stage_runtime", "demo", "--limit-requests", "5"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            timeout=120,
            check=False,
        )
    assert done.returncode == 1
    assert done.stderr == (
        "stage-runtime demo: error: cannot write the report to stdout: No space left on device\n"
    )
