"""What the documentation promises beyond its code blocks (those run through Sybil, from the
repository's conftest.py): the fixtures example runs as a test of a user's project would, every
actor log event is described, and the README stays a short entry point."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _python_blocks(page: str) -> list[str]:
    text = (DOCS / page).read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


# The fixtures example of the server page becomes a test of this module, run by pytest with the
# plugin's fixtures exactly as it would run in a user's project.
[_FIXTURE_EXAMPLE] = [block for block in _python_blocks("server.md") if "def test_" in block]
exec(compile(_FIXTURE_EXAMPLE, "docs/server.md#fixtures", "exec"), globals())


def test_the_fixtures_example_defined_a_test() -> None:
    assert "test_second_prefill_is_restored" in globals()


def test_the_actors_page_names_every_log_event() -> None:
    """Every event name the actors package logs is described on its page."""
    page = (DOCS / "actors.md").read_text(encoding="utf-8")
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "actors").glob("*.py"))
    logged = set(re.findall(r"log\.\w+\(\s*\"(actor_\w+)\"", source))
    assert {"actor_started", "actor_stopped", "actor_hook_failed"} <= logged
    assert {event for event in logged if f"`{event}`" not in page} == set()


def test_the_readme_is_short_and_links_pages_that_exist() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    linked = re.findall(r"\]\(docs/([\w-]+)\.md\)", readme)
    assert linked
    assert [page for page in linked if not (DOCS / f"{page}.md").is_file()] == []
    pages = {path.stem for path in DOCS.glob("*.md")} - {"index", "api"}
    assert pages <= set(linked)
