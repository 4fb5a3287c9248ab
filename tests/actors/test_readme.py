"""The README's actors example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[2] / "README.md"


def test_readme_actors_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The python block of the actors section executes and prints statistics."""
    text = README.read_text(encoding="utf-8")
    section = text.split("<!-- section: actors -->", 1)[1].split("<!-- section:", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    exec(compile(code, "README.md#actors", "exec"), {"__name__": "readme_actors"})
    assert "ActorStatistics(mailbox_size=64" in capsys.readouterr().out


def test_readme_actors_section_names_every_log_event() -> None:
    """Every event name the actors package logs is described in its README section."""
    text = README.read_text(encoding="utf-8")
    section = text.split("<!-- section: actors -->", 1)[1].split("<!-- section:", 1)[0]
    package = Path(__file__).parents[2] / "actors"
    source = "\n".join(path.read_text(encoding="utf-8") for path in package.glob("*.py"))
    logged = set(re.findall(r"log\.\w+\(\s*\"(actor_\w+)\"", source))
    assert {"actor_started", "actor_stopped", "actor_hook_failed"} <= logged
    assert {event for event in logged if f"`{event}`" not in section} == set()
