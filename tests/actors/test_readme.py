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
