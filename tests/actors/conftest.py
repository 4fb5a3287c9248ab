"""Fixtures for the actor tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from actors.testing import LogEvent, capture_actor_logs


@pytest.fixture(autouse=True)
def actor_logs() -> Iterator[list[LogEvent]]:
    """Capture every log event of the test (keeps crash tracebacks off the terminal)."""
    with capture_actor_logs() as logs:
        yield logs
