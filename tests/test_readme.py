"""The README's code blocks run as written, and print what their comments say.

Each block is taken from its ``<!-- section: ... -->`` so that editing the README re-tests it.
(The actors section's block runs in ``tests/actors/test_readme.py``.)
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
import trio

from stage_runtime import load_topology
from stage_runtime.server import PipelineApp, open_server
from stage_runtime.server import serve as real_serve

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def section(name: str) -> str:
    """The README text between ``<!-- section: name -->`` and the next section marker."""
    return README.split(f"<!-- section: {name} -->", 1)[1].split("<!-- section:", 1)[0]


def blocks(name: str, language: str) -> list[str]:
    """The fenced ``language`` code blocks of a README section, in order."""
    return re.findall(rf"```{language}\n(.*?)```", section(name), flags=re.DOTALL)


def run_block(code: str, name: str) -> dict[str, Any]:
    """Execute a README block as a module body; return its namespace."""
    namespace: dict[str, Any] = {"__name__": f"readme_{name}"}
    exec(compile(code, f"README.md#{name}", "exec"), namespace)
    return namespace


@pytest.fixture(autouse=True)
def _from_the_repository_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """README blocks name files relative to the repository root, as a reader runs them."""
    monkeypatch.chdir(ROOT)
    saved = structlog.get_config()
    yield
    structlog.reset_defaults()
    structlog.configure(**saved)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_contents_links_every_section_heading() -> None:
    """The contents line links each top-level heading, in order, by an anchor that exists."""
    headings = re.findall(r"^## (.+)$", README, flags=re.MULTILINE)
    contents = README.split("Contents:", 1)[1].split("<!-- section:", 1)[0]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    assert _anchor("Embedding: HTTP server and test fixtures") == (
        "embedding-http-server-and-test-fixtures"
    )
    assert links == [_anchor(heading) for heading in headings]


def test_core_block_records_the_ladder_and_restores_the_grid_prefix() -> None:
    """The core block records [2214, 2176] and a 17-token extension restores 2176 tokens."""
    [code] = blocks("core", "python")
    namespace = run_block(code, "core")
    assert "# [2214, 2176]" in code
    assert [record.token_count for record in namespace["records"]] == [2214, 2176]
    assert "# 2176: compute only the last 55 tokens" in code
    assert namespace["hit"].token_count == 2176
    assert namespace["longer"].size - namespace["hit"].token_count == 55


def test_pipeline_block_prints_the_numbers_its_comment_claims(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The pipeline block runs on examples/topology.toml and prints "2176 55" for every stage."""
    [code] = blocks("pipeline", "python")
    claimed = re.search(r"print\(report\.stage_id.*#\s*(\d+) (\d+)", code)
    assert claimed is not None
    run_block(code, "pipeline")
    out = capsys.readouterr().out
    stage_ids = [config.stage_id for config in load_topology(ROOT / "examples/topology.toml")]
    for stage_id in stage_ids:
        assert f"{stage_id} {claimed[1]} {claimed[2]}\n" in out
    assert "PipelineStats(stages=" in out


def test_pipeline_toml_block_is_a_valid_topology(tmp_path: Path) -> None:
    """The topology file shown in the pipeline section loads: two contiguous stages."""
    [topology] = blocks("pipeline", "toml")
    path = tmp_path / "topology.toml"
    path.write_text(topology, encoding="utf-8")
    stages = load_topology(path)
    assert [(s.stage_id, s.layer_start, s.layer_end) for s in stages] == [
        ("stage-0", 0, 8),
        ("stage-1", 8, 16),
    ]
    assert stages[0].kv_cache is not None
    assert stages[0].kv_cache.min_tokens == 256


async def test_server_block_serves_prefills_on_the_example_topology() -> None:
    """The server block's main() serves the example topology; a repeated prompt is restored.

    ``serve`` is swapped for a stand-in with the same signature that listens on a free port
    (the README's 8000 may be taken), sends a prompt twice and returns instead of waiting for a
    signal.
    """
    [code] = [block for block in blocks("server", "python") if "create_app" in block]
    namespace = run_block(code, "server")
    answers: list[dict[str, Any]] = []

    async def serve(app: PipelineApp, **kwargs: Any) -> None:
        inspect.signature(real_serve).bind(app, **kwargs)  # the README's call is valid
        assert kwargs["bind"] == "127.0.0.1:8000"
        async with (
            open_server(app, bind="127.0.0.1:0") as server,
            httpx.AsyncClient(base_url=server.url, timeout=20) as client,
        ):
            body = {"text": "Summarise this report. " * 4, "session_id": "s1"}
            for _ in range(2):
                answer = await client.post("/v1/prefill", json=body)
                answers.append(answer.raise_for_status().json())

    namespace["serve"] = serve
    with trio.fail_after(20):
        await namespace["main"]()
    first, second = answers
    assert [stage["restored_tokens"] for stage in first["stages"]] == [0, 0, 0, 0]
    assert all(stage["restored_tokens"] > 0 for stage in second["stages"])


# The fixtures example of the server section becomes a test of this module, run by pytest with
# the plugin's fixtures exactly as it would run in a user's project.
[_FIXTURE_EXAMPLE] = [block for block in blocks("server", "python") if "def test_" in block]
exec(compile(_FIXTURE_EXAMPLE, "README.md#server-fixtures", "exec"), globals())


def test_placement_block_runs_each_stage_in_its_own_ray_process(
    ray_cluster: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The placement block restores what its comment says, from 4 stage processes."""
    [code] = blocks("placement", "python")
    assert "# [2176, 2176, 2176, 2176]" in code
    run_block(code, "placement")
    out = capsys.readouterr().out
    assert "[2176, 2176, 2176, 2176]\n4\n" in out


def test_placement_toml_block_is_a_valid_placement_table(tmp_path: Path) -> None:
    """The [placement] table shown in the README loads as the RayPlacement it describes."""
    from actors import RestartPolicy
    from stage_runtime.pipeline import load_placement
    from stage_runtime.placement import RayPlacement

    [table] = blocks("placement", "toml")
    path = tmp_path / "topology.toml"
    path.write_text((ROOT / "examples/topology.toml").read_text() + "\n" + table)
    assert load_placement(path) == RayPlacement(
        address="auto",
        num_cpus=1,
        strategy="STRICT_SPREAD",
        restart=RestartPolicy(max_restarts=3, within_s=60),
    )
