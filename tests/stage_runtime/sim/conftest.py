"""Fixtures for fanned-out replays: a pool of worker processes, and Ray."""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest

from stage_runtime._cli_support import configure_logging

QUIET = functools.partial(configure_logging, level="warning")
"""A unit's logging in tests: warnings only (the default follows this process, which logs
every record at debug level when nothing configured it)."""


@pytest.fixture(scope="session")
def process_pool() -> Iterator[concurrent.futures.Executor]:
    """Two spawned worker processes for the session (starting them takes about a second)."""
    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=2, mp_context=multiprocessing.get_context("spawn")
    )
    with pool:
        yield pool


@pytest.fixture
def local_ray(ray_cluster: Any) -> None:
    """This process connected to Ray: the session's cluster (``tests/conftest.py``)."""
