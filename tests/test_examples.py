"""Runs every program in ``examples/``: each defines ``async def main()``."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    """Examples configure structlog like programs do; put the test's configuration back."""
    saved = structlog.get_config()
    yield
    structlog.reset_defaults()
    structlog.configure(**saved)


def test_there_are_examples() -> None:
    """The glob finds the examples directory (so the parametrized test below is not empty)."""
    assert any(path.name == "two_stage_pipeline.py" for path in EXAMPLES)


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.stem for path in EXAMPLES])
async def test_example_runs(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The example's main() runs to completion and prints something."""
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    await module.main()
    assert capsys.readouterr().out.strip()


async def test_two_stage_example_shows_restores_and_evictions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The pipeline example prints its per-stage table and the cache's log events."""
    path = next(path for path in EXAMPLES if path.name == "two_stage_pipeline.py")
    spec = importlib.util.spec_from_file_location("example_two_stage", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    await module.main()
    out = capsys.readouterr().out
    for event in ("activation_missed", "activation_restored", "activation_recorded"):
        assert event in out
    assert "activation_evicted" in out
    assert "reason=max_entries" in out
    assert "stage=stage-1" in out
    assert "A turn 3 again" in out
