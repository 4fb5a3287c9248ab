"""Fixtures for fanned-out replays: a pool of worker processes, and a local Ray instance."""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator

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


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """This process connected to Ray for the module: a Ray instance the suite already joined,
    else a local one of 4 logical CPUs started here, shut down at the end.

    Everything Ray writes goes under a temporary directory (a short path: Ray's socket paths
    must stay under about 100 bytes), removed at the end; token authentication is off, so
    nothing is written to ``~/.ray``. Skipped without Ray.
    """
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # the session's cluster (tests/conftest.py), joined already
        yield
        return
    temp = tempfile.mkdtemp(prefix="sr-ray-")
    saved = {name: os.environ.get(name) for name in ("RAY_TMPDIR", "RAY_AUTH_MODE")}
    os.environ["RAY_TMPDIR"] = temp
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp, log_to_driver=False)
        yield
    finally:
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(temp, ignore_errors=True)
