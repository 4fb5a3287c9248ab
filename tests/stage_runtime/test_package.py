"""The package re-exports every public name of its core modules."""

from __future__ import annotations

import importlib

import pytest

import stage_runtime

# Modules whose public names users import from the package itself. The sub-packages and tool
# modules (server, sim, cli, data, testing) are namespaces of their own.
CORE_MODULES = [
    "accounting",
    "cache",
    "cache_actor",
    "config",
    "errors",
    "frames",
    "identity",
    "integration",
    "models",
    "cache.paged",
    "pipeline",
    "policy",
    "stage",
    "tenancy",
]


@pytest.mark.parametrize("module", CORE_MODULES)
def test_module_public_names_are_exported_from_the_package(module: str) -> None:
    """Each name in a core module's __all__ is in stage_runtime.__all__ and is the same object."""
    mod = importlib.import_module(f"stage_runtime.{module}")
    missing = [name for name in mod.__all__ if name not in stage_runtime.__all__]
    assert missing == []
    assert all(getattr(stage_runtime, name) is getattr(mod, name) for name in mod.__all__)


def test_package_all_names_exist_once() -> None:
    """stage_runtime.__all__ lists each name once and every name resolves."""
    names = stage_runtime.__all__
    assert len(names) == len(set(names))
    assert all(hasattr(stage_runtime, name) for name in names)
