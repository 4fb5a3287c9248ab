"""HTTP serving for one embedded pipeline (install the ``server`` extra to serve).

The application (:func:`create_app`) is an ASGI app built on Starlette; mount it in your own
Starlette or FastAPI app, or run it with :func:`serve` / :func:`open_server` on hypercorn's trio
worker inside the caller's own trio program, next to the pipeline.

The application and metrics names are imported on first use, so that
``stage_runtime.server.command`` (which the ``stage-runtime`` command line imports) works, and
reports the missing extra, without the ``server`` extra's packages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stage_runtime.server.requests import InvalidRequestError, PrefillBody, parse_prefill_request
from stage_runtime.server.serve import RunningServer, open_server, serve
from stage_runtime.server.settings import ServerSettings
from stage_runtime.server.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from stage_runtime.server.app import PipelineApp, ServedPipeline, create_app
    from stage_runtime.server.metrics import MetricFamily, MetricsExporter, Sample

# What needs Starlette or prometheus_client, imported on first use.
_HOMES = {
    "MetricFamily": "stage_runtime.server.metrics",
    "MetricsExporter": "stage_runtime.server.metrics",
    "PipelineApp": "stage_runtime.server.app",
    "Sample": "stage_runtime.server.metrics",
    "ServedPipeline": "stage_runtime.server.app",
    "create_app": "stage_runtime.server.app",
}

__all__ = [
    "ByteTokenizer",
    "InvalidRequestError",
    "MetricFamily",
    "MetricsExporter",
    "PipelineApp",
    "PrefillBody",
    "RunningServer",
    "Sample",
    "ServedPipeline",
    "ServerSettings",
    "create_app",
    "open_server",
    "parse_prefill_request",
    "serve",
]


def __getattr__(name: str) -> Any:
    module = _HOMES.get(name)
    if module is None:
        msg = f"module 'stage_runtime.server' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
