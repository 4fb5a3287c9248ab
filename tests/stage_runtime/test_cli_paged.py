"""The replay command with --index paged: the same trace, a shared prefix off the ladder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from stage_runtime.cli import main
from stage_runtime.config import CacheIndex
from stage_runtime.errors import ConfigError
from stage_runtime.sim import SimConfig, kv_cache_config

# The second prompt shares blocks 1 and 2 (32 tokens) with the first, which the ladder recorded
# only at 64 and 48 tokens: the ladder cannot restore it, the paged index can.
TRACE = [
    {"timestamp": 0, "input_length": 64, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 5, "input_length": 48, "output_length": 1, "hash_ids": [1, 2, 9]},
]
SMALL = ["--block-size", "16", "--bytes-per-token", "2", "--stages", "2"]


def _replay(tmp_path: Path, *extra: str) -> dict[str, object]:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in TRACE) + "\n", encoding="utf-8")
    # A subprocess, as a user runs it: a full run configures structlog for the process.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stage_runtime",
            "replay",
            str(trace),
            *SMALL,
            *extra,
            "--json",
            "-",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert isinstance(document, dict)
    return document


def test_replay_index_paged_restores_what_the_ladder_cannot(tmp_path: Path) -> None:
    """--index paged restores the 32 shared tokens; the default ladder restores none."""
    ladder = _replay(tmp_path)
    paged = _replay(tmp_path, "--index", "paged")
    assert ladder["restored_tokens"] == 0
    assert paged["restored_tokens"] == 32
    config = paged["config"]
    assert isinstance(config, dict)
    assert config["index"] == "paged"
    assert config["page_tokens"] == 16


def test_replay_rejects_an_unknown_index(capsys: pytest.CaptureFixture[str]) -> None:
    """--index takes only ladder or paged."""
    with pytest.raises(SystemExit) as raised:
        main(["replay", "t.jsonl", "--index", "radix"])
    assert raised.value.code == 2
    assert "invalid choice: 'radix'" in capsys.readouterr().err


def test_sim_config_passes_the_index_to_every_stage() -> None:
    """SimConfig.index and page_tokens reach the stages' KvCacheConfig; bad values are named."""
    cache = kv_cache_config(SimConfig(index="paged", page_tokens=256))
    assert cache.index is CacheIndex.PAGED
    assert cache.effective_page_tokens == 256
    assert kv_cache_config(SimConfig()).index is CacheIndex.LADDER
    with pytest.raises(ConfigError, match="index must be 'ladder' or 'paged', got 'tree'"):
        SimConfig(index="tree")


def test_the_report_header_describes_the_index_in_use(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With --index paged the header names the pages and eviction, not the ladder's settings."""
    saved = structlog.get_config()  # main() configures logging like a program does
    try:
        _header_checks(capsys)
    finally:
        structlog.reset_defaults()
        structlog.configure(**saved)


def _header_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--index", "paged", "--limit-requests", "5", "--page-tokens", "256"]) == 0
    header = " ".join(capsys.readouterr().out.split())
    assert "paged: pages of 256 tokens, lru eviction, min 512 tokens" in header
    assert "record limit" not in header
    assert main(["demo", "--limit-requests", "5"]) == 0
    assert "ladder: min 512 tokens, stride 512, record limit 2" in capsys.readouterr().out
    # The upstream caps the grid's spacing at the min tokens: the header says which applies.
    assert main(["demo", "--limit-requests", "5", "--min-tokens", "64", "--stride", "128"]) == 0
    header = " ".join(capsys.readouterr().out.split())
    assert "stride 128 (grid every 64: capped at the min), record limit 2" in header
