"""The package's tiered API: a short top level, named explicitly; everything else in modules."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import stage_runtime

# What a user of the README touches. A name joins this list deliberately, never by default.
TOP_LEVEL = {
    "ActivationDType",
    "ActivationDesc",
    "ActivationFrame",
    "ActivationLayout",
    "CacheIndex",
    "CacheMode",
    "ConfigError",
    "FrameError",
    "KvCacheConfig",
    "LocalPlacement",
    "ModelFactory",
    "PageEviction",
    "Pipeline",
    "PipelineStats",
    "PipelineStoppedError",
    "PrefillResult",
    "RayPlacement",
    "StageConfig",
    "StageFailedError",
    "StageModel",
    "StagePrefillReport",
    "StageRuntimeError",
    "TraceFormatError",
    "load_model",
    "load_topology",
    "open_pipeline",
    "reference_model_factory",
    "validate_topology",
    "virtual_model_factory",
}

# The namespaces the rest lives in; each lists its public names in __all__.
MODULES = [
    "accounting",
    "cache",
    "cache.paged",
    "cache_actor",
    "config",
    "errors",
    "frames",
    "identity",
    "integration",
    "models",
    "pipeline",
    "placement",
    "policy",
    "server",
    "sim",
    "stage",
    "tenancy",
    "testing",
]


def test_the_top_level_is_the_allow_list() -> None:
    assert set(stage_runtime.__all__) == TOP_LEVEL
    assert len(stage_runtime.__all__) == len(TOP_LEVEL) <= 30


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_of_a_module_resolves(module: str) -> None:
    mod = importlib.import_module(f"stage_runtime.{module}")
    names = mod.__all__
    assert len(names) == len(set(names))
    assert [name for name in names if not hasattr(mod, name)] == []


def test_top_level_names_are_their_modules_objects() -> None:
    homes = [importlib.import_module(f"stage_runtime.{m}") for m in MODULES]
    for name in stage_runtime.__all__:
        value = getattr(stage_runtime, name)
        assert any(getattr(mod, name, None) is value for mod in homes), name


@pytest.mark.parametrize("name", sorted(stage_runtime._MOVED))
def test_a_moved_name_still_resolves_with_a_warning_naming_its_module(name: str) -> None:
    module = stage_runtime._MOVED[name]
    with pytest.warns(DeprecationWarning, match=rf"import it from {module}$"):
        value = getattr(stage_runtime, name)
    assert value is getattr(importlib.import_module(module), name)
    assert name in importlib.import_module(module).__all__
    assert name not in stage_runtime.__all__


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = stage_runtime.no_such_name


def test_importing_the_package_imports_no_optional_extra() -> None:
    """The top level stays importable without the server, Ray, plot or llama extras."""
    code = (
        "import sys, stage_runtime; "
        "print(sorted(m for m in ('ray', 'hypercorn', 'matplotlib', 'tokenizers') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
