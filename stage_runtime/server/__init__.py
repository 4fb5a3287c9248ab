"""HTTP serving for one embedded pipeline (install the ``server`` extra to serve).

The application is plain ASGI (:func:`create_app`); :func:`serve` / :func:`open_server` run it on
hypercorn's trio worker inside the caller's own trio program, next to the pipeline. Importing this
package does not import hypercorn: only serving does.
"""

from __future__ import annotations

from stage_runtime.server.app import PipelineApp, ServedPipeline, ServerSettings, create_app
from stage_runtime.server.metrics import MetricFamily, MetricsExporter, Sample
from stage_runtime.server.requests import (
    InvalidRequestError,
    PrefillBody,
    parse_prefill_request,
)
from stage_runtime.server.serve import RunningServer, open_server, serve
from stage_runtime.server.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "InvalidRequestError",
    "MetricFamily",
    "PipelineApp",
    "PrefillBody",
    "RunningServer",
    "Sample",
    "ServedPipeline",
    "ServerSettings",
    "create_app",
    "open_server",
    "parse_prefill_request",
    "MetricsExporter",
    "serve",
]
