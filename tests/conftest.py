"""Fixtures shared by the whole suite."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from hypothesis import settings

# The suite is deterministic: hypothesis draws the same examples on every run and keeps no
# example database (which it would write under the working directory). A developer who wants
# fresh examples runs it with HYPOTHESIS_PROFILE=explore.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


_SCRATCH_VARIABLES = {"MPLCONFIGDIR": "sr-mpl-", "HYPOTHESIS_STORAGE_DIRECTORY": "sr-hypothesis-"}
_scratch: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    """matplotlib (the plots of a replay report) writes its cache under ``~/.config``, and
    hypothesis its files under ``./.hypothesis``, unless told otherwise: the suite points each
    at a temporary directory, removed at the end."""
    for variable, prefix in _SCRATCH_VARIABLES.items():
        if variable not in os.environ:
            _scratch[variable] = os.environ[variable] = tempfile.mkdtemp(prefix=prefix)


def pytest_unconfigure(config: pytest.Config) -> None:
    for variable, directory in _scratch.items():
        os.environ.pop(variable, None)
        shutil.rmtree(directory, ignore_errors=True)
    _scratch.clear()


@pytest.fixture(autouse=True)
def _logging_left_as_found() -> Iterator[None]:
    """Each test leaves structlog's and the root logger's configuration as it found them: a
    command run in-process configures them to print to its (captured, then closed) stderr,
    which a later test's events would hit."""
    saved = dict(structlog.get_config())
    handlers, level = logging.root.handlers[:], logging.root.level
    yield
    structlog.configure(**saved)
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A two-node Ray cluster on this machine for the session, this process connected to it.

    Logical CPUs (4 a node) let several fractional-CPU stages share the machine's cores. Every
    file Ray writes goes under one temporary directory (``RAY_TMPDIR``), removed at the end;
    token authentication is off, so nothing is written to ``~/.ray``. Skipped without Ray.
    """
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    import tests.stage_runtime.pipeline_helpers
    import tests.stage_runtime.ray_helpers

    temp = tempfile.mkdtemp(prefix="sr-ray-")
    saved = {name: os.environ.get(name) for name in ("RAY_TMPDIR", "RAY_AUTH_MODE")}
    os.environ["RAY_TMPDIR"] = temp
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Test helpers travel to the stage processes by value: those need not import the suite.
    for module in (tests.stage_runtime.ray_helpers, tests.stage_runtime.pipeline_helpers):
        ray.cloudpickle.register_pickle_by_value(module)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "resources": {"node-a": 1}, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=4, resources={"node-b": 1})
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
        for module in (tests.stage_runtime.ray_helpers, tests.stage_runtime.pipeline_helpers):
            ray.cloudpickle.unregister_pickle_by_value(module)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(temp, ignore_errors=True)
