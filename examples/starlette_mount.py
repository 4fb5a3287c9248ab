"""The pipeline's HTTP API mounted inside your own Starlette app, served by hypercorn.

The service below has a route of its own (``/``) and mounts the pipeline's app under
``/pipeline`` (``/pipeline/v1/prefill``, ``/pipeline/v1/stats``, ``/pipeline/metrics``, ...),
with its limits and accounting. In FastAPI the same is ``app.mount("/pipeline", pipeline_app)``.
Hypercorn's trio worker (``hypercorn.trio.serve``) runs it inside this trio program, next to the
pipeline; the program sends a prompt twice, then shuts the server down.

Run it with ``python examples/starlette_mount.py`` (needs the ``server`` extra and httpx).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from stage_runtime import Pipeline, open_pipeline, reference_model_factory
from stage_runtime.server import create_app

if TYPE_CHECKING:
    from hypercorn.typing import ASGIFramework

TOPOLOGY = Path(__file__).with_name("topology.toml")


def service(pipeline: Pipeline) -> Starlette:
    """Your own app: a home page, and the pipeline's endpoints under /pipeline."""

    async def home(request: Request) -> PlainTextResponse:
        return PlainTextResponse("railway assistant: POST prompts to /pipeline/v1/prefill\n")

    return Starlette(
        routes=[Route("/", home), Mount("/pipeline", app=create_app(pipeline))],
    )


async def main() -> dict[str, Any]:
    """Serve on a free port, use both the service's route and the pipeline's, shut down."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    stop = trio.Event()
    async with (
        open_pipeline(TOPOLOGY, reference_model_factory()) as pipeline,
        trio.open_nursery() as nursery,
    ):
        # Starlette speaks ASGI with plain mappings, hypercorn's annotations with TypedDicts.
        app = cast("ASGIFramework", service(pipeline))
        [url] = await nursery.start(
            lambda task_status: serve(
                app, config, shutdown_trigger=stop.wait, task_status=task_status
            )
        )
        async with httpx.AsyncClient(base_url=url) as client:
            home = (await client.get("/")).raise_for_status().text
            body = {"text": "When is the next train to Edinburgh? " * 3, "session_id": "s1"}
            answers = [
                (await client.post("/pipeline/v1/prefill", json=body)).raise_for_status().json()
                for _ in range(2)
            ]
            ready = (await client.get("/pipeline/readyz")).json()
        stop.set()
    print(home.strip())
    for answer in answers:
        restored = [stage["restored_tokens"] for stage in answer["stages"]]
        print(f"{answer['tokens']} tokens, restored per stage {restored}")
    print(f"readiness: {ready['status']}")
    return {"home": home, "answers": answers, "ready": ready}


if __name__ == "__main__":
    from stage_runtime.server.command import configure_logging

    configure_logging(level="warning")  # the library's events on stderr, warnings and up
    trio.run(main)
