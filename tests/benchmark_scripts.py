"""Load a ``benchmarks/`` script or an ``examples/`` program as a fresh module, for tests of its
functions (nothing is timed)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).parents[1]
BENCHMARKS = ROOT / "benchmarks"
EXAMPLES = ROOT / "examples"


def load_module(path: Path, name: str) -> ModuleType:
    """The Python file ``path`` as a fresh module named ``name`` (not put in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = dict(os.environ)
    try:
        spec.loader.exec_module(module)
    finally:
        # A script may set variables for the process it runs in (bench_http's BLAS threads);
        # the suite's own environment stays as it was.
        os.environ.clear()
        os.environ.update(saved)
    return module


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a fresh module named ``name``."""
    return load_module(BENCHMARKS / f"{name}.py", name)


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a fresh module named ``example_<name>``."""
    return load_module(EXAMPLES / f"{name}.py", f"example_{name}")
