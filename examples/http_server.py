"""Serve a 4-stage pipeline over HTTP, in the same trio program as the pipeline.

Start it (needs the ``server`` extra: ``pip install -e '.[server]'``)::

    python examples/http_server.py                 # http://127.0.0.1:8000, Ctrl-C to stop
    python examples/http_server.py 0.0.0.0:9000    # another address
    python examples/http_server.py 127.0.0.1:0     # a free port (the first line shows it)

The same server, from the command line::

    stage-runtime serve --topology examples/topology.toml --bind 127.0.0.1:8000

Query it (the second identical prompt is restored from every stage's activation cache; prompts
shorter than the topology's ``min_tokens = 64``, i.e. 64 bytes of text, are never cached)::

    curl -s localhost:8000/v1/prefill \\
        -d '{"text": "Summarise the report in three sentences, then list its open questions.",
             "session_id": "s1"}'
    curl -s localhost:8000/v1/prefill \\
        -d '{"text": "Summarise the report in three sentences, then list its open questions.",
             "session_id": "s1"}'
    curl -s localhost:8000/v1/prefill \\
        -d '{"tokens": [101, 2023, 2003, 1037, 3231], "session_id": "s2", "request_id": "r-1"}'
    curl -s localhost:8000/v1/stats
    curl -s localhost:8000/metrics
    curl -si localhost:8000/readyz
    curl -s localhost:8000/v1/prefill -d '{"tokens": [], "session_id": "s1"}'  # 400: "tokens"

``"text"`` is tokenized byte by byte (UTF-8 bytes as token ids 0..255); real deployments send
``"tokens"`` from their model's tokenizer. ``Ctrl-C`` (or SIGTERM) drains: new connections are
refused, in-flight prefills finish (any still running after ``shutdown_timeout_s``, 30 s, get a
``503``), then the pipeline stops; a second ``Ctrl-C`` stops at once.

:func:`main` is the self-contained tour the tests run: it serves on a free port, sends a few real
requests with httpx and shuts down.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import trio

from stage_runtime.errors import ConfigError
from stage_runtime.models import reference_model_factory
from stage_runtime.pipeline import open_pipeline
from stage_runtime.server import (
    ServerSettings,
    create_app,
    open_server,
    serve,
)

TOPOLOGY = Path(__file__).with_name("topology.toml")
PROMPT = "Summarise the following report in three sentences, then list the open questions."


async def serve_until_interrupted(bind: str = "127.0.0.1:8000") -> None:
    """Serve the 4-stage pipeline on ``bind`` until SIGINT/SIGTERM, then drain and stop."""
    async with (
        open_pipeline(TOPOLOGY, reference_model_factory(width=64)) as pipeline,
        trio.open_nursery() as nursery,
    ):
        app = create_app(pipeline, settings=ServerSettings(max_inflight=32))
        # start() returns once the socket listens, with the real URL (port 0 picks a free one).
        server = await nursery.start(partial(serve, app, bind=bind, handle_signals=True))
        stages = len(pipeline.stage_configs)
        print(f"serving {stages} stages on {server.url} (Ctrl-C to stop)", flush=True)
    # The nursery returns once the server has drained; leaving open_pipeline stops the stages.


async def main() -> dict[str, Any]:
    """Serve on a free port, prefill the same prompt twice, read the stats, shut down.

    Returns:
        The two prefill responses and the stats document, as JSON values.
    """
    import httpx  # the client is only needed for this tour, not for serving

    async with (
        open_pipeline(TOPOLOGY, reference_model_factory(width=64)) as pipeline,
        open_server(create_app(pipeline), bind="127.0.0.1:0") as server,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        request = {"text": PROMPT, "session_id": "example"}
        first = (await client.post("/v1/prefill", json=request)).raise_for_status().json()
        second = (await client.post("/v1/prefill", json=request)).raise_for_status().json()
        stats = (await client.get("/v1/stats")).raise_for_status().json()
    for name, answer in (("first", first), ("second", second)):
        restored = [stage["restored_tokens"] for stage in answer["stages"]]
        print(f"{name}: {answer['tokens']} tokens, restored per stage {restored}")
    return {"first": first, "second": second, "stats": stats}


if __name__ == "__main__":
    from stage_runtime.server.command import configure_logging

    configure_logging()
    try:
        trio.run(serve_until_interrupted, sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:8000")
    except* (ConfigError, OSError) as group:  # a bad address, or one we cannot listen on
        error: BaseException = group
        while isinstance(error, BaseExceptionGroup):  # trio's nurseries nest the groups
            error = error.exceptions[0]
        sys.exit(f"http_server.py: error: {error}")
