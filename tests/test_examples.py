"""Runs every program in ``examples/``: each defines ``async def main()``."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import structlog
import trio.testing

from tests.benchmark_scripts import load_module

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))
REAL_CLOCK = {"http_server", "llama_server", "starlette_mount"}
"""Examples that talk to real sockets, so they run on the real clock; the rest on virtual time."""
VIRTUAL = [path for path in EXAMPLES if path.stem not in REAL_CLOCK]
NETWORK = [path for path in EXAMPLES if path.stem in REAL_CLOCK]


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    """Examples configure structlog like programs do; put the test's configuration back."""
    saved = structlog.get_config()
    yield
    structlog.reset_defaults()
    structlog.configure(**saved)


def load(path: Path) -> ModuleType:
    return load_module(path, f"example_{path.stem}")


def example(name: str) -> Path:
    return next(path for path in EXAMPLES if path.stem == name)


def test_there_are_examples() -> None:
    """The glob finds the examples directory (so the parametrized tests below are not empty)."""
    assert {"two_stage_pipeline", "multi_stage_simulation"} <= {path.stem for path in VIRTUAL}


@pytest.mark.parametrize("path", VIRTUAL, ids=[path.stem for path in VIRTUAL])
async def test_example_runs(
    path: Path, autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    """The example's main() runs to completion (in virtual time) and prints something."""
    await load(path).main()
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("path", NETWORK, ids=[path.stem for path in NETWORK])
async def test_network_example_runs(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An example serving on a real socket runs to completion and prints something."""
    await load(path).main()
    assert capsys.readouterr().out.strip()


async def test_two_stage_example_shows_restores_and_evictions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The pipeline example prints its per-stage table and accounting that agrees with it on
    stdout, and the cache's log events on stderr."""
    await load(example("two_stage_pipeline")).main()
    captured = capsys.readouterr()
    out, log = captured.out, captured.err
    for event in ("activation_missed", "activation_restored", "activation_recorded"):
        assert event in log
        assert event not in out
    assert "activation_evicted" in log
    assert "reason=max_entries" in log
    assert "stage=stage-1" in log
    rows = re.findall(r"^([AB] turn \d[a-z ]*?)\s+(\d+)\s+((?:\d+ / \d+\s*){2})$", out, re.M)
    assert [label for label, _, _ in rows][-1] == "A turn 3 again"
    assert len(rows) == 6
    table = [
        (int(n), [tuple(map(int, cell.split(" / "))) for cell in re.findall(r"\d+ / \d+", cells)])
        for _, n, cells in rows
    ]
    assert all(k + c == n for n, stages in table for k, c in stages)
    assert table[-1][1] == [(table[-1][0], 0), (table[-1][0], 0)]  # the repeat is restored whole
    total = sum(n for n, _ in table)
    for index in (0, 1):
        restored = [stages[index][0] for _, stages in table]
        hits = sum(1 for k in restored if k)
        line = (
            f"stage-{index}: 6 restores: {hits} hit, {6 - hits} missed (never seen 1, "
            f"evicted 0, rejected 0); {sum(restored):,} of {total:,} prompt tokens restored"
        )
        assert line in out
    assert re.search(r"^ {9}6 entries resident \([\d,]+ bytes\), 8 evicted", out, re.M)


async def test_simulation_example_prints_each_stages_hits_and_misses(
    autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    """The simulation example's per-stage accounting agrees with its stage-0 headline."""
    await load(example("multi_stage_simulation")).main()
    out = capsys.readouterr().out
    headline = re.search(r"^(\d+) requests: stage 0 restored ([\d,]+) of", out, re.M)
    assert headline is not None
    stages = re.findall(
        r"^  (stage-\d): (\d+) hit / (\d+) missed of (\d+) restores .*?, ([\d,]+) tokens restored",
        out,
        re.M,
    )
    assert [stage for stage, *_ in stages] == [f"stage-{i}" for i in range(4)]
    requests = int(headline[1])
    for _, hit, missed, restores, _ in stages:
        assert int(hit) + int(missed) == int(restores) == requests
    assert stages[0][4] == headline[2]


def test_the_http_server_example_names_a_bad_address_in_one_line() -> None:
    """A bad address is one line and exit code 1, not an exception-group traceback."""
    done = subprocess.run(
        [sys.executable, str(example("http_server")), "nohost"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "http_server.py: error: bind must be HOST:PORT with PORT in 0..65535, got 'nohost'"
    )
    assert "Traceback" not in done.stderr


async def test_the_starlette_example_serves_its_own_route_and_the_mounted_pipeline() -> None:
    """The service answers its own route; the mounted pipeline restores a repeated prompt at
    every stage and reports ready."""
    result = await load(example("starlette_mount")).main()
    assert result["home"].startswith("railway assistant")
    first, second = result["answers"]
    assert [stage["restored_tokens"] for stage in first["stages"]] == [0, 0, 0, 0]
    assert [stage["restored_tokens"] for stage in second["stages"]] == [second["tokens"]] * 4
    assert result["ready"] == {"status": "ready"}
