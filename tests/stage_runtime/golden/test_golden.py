"""The caches behave as the golden fingerprints taken before the refactor of issue 20 say.

The excerpt's fingerprints are checked by ``benchmarks/check_golden.py --excerpt`` in a fresh
process (an earlier test may have cached a library logger, whose events a capture would miss);
the rest checks what the fingerprints are made of and how a difference is reported.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stage_runtime.sim import SimRequest, read_demo_trace
from tests.benchmark_scripts import BENCHMARKS, ROOT, load_script
from tests.stage_runtime.golden.fingerprint import (
    EXCERPT_CAPACITIES,
    FORMAT,
    Scenario,
    _ranked_names,
    compare,
    golden_document,
    scenarios,
    trace_digest,
)

GOLDEN = Path(__file__).with_name("excerpt.json")


def _golden() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(GOLDEN.read_text(encoding="utf-8"))
    return document


def test_excerpt_fingerprints_equal_the_golden_ones() -> None:
    """Every restore, record, eviction, counter and cache log event of the excerpt's replays
    (ladder, paged LRU, paged reuse at two capacities, 4 stages) is what it was."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "check_golden.py"), "--excerpt", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all 6 fingerprints equal the golden ones" in done.stdout


def test_golden_data_covers_every_policy_at_both_capacities_with_evictions() -> None:
    """The golden excerpt exercises what the refactor could break: every policy evicts, hits
    and misses at both capacities, and LRU and reuse eviction do differ."""
    golden = _golden()
    assert golden["format"] == FORMAT
    requests = read_demo_trace().requests
    assert golden["trace_digest"] == trace_digest(requests)
    assert sorted(golden["scenarios"]) == sorted(s.name for s in scenarios(EXCERPT_CAPACITIES))
    for name, found in golden["scenarios"].items():
        counts = found["counts"]
        assert counts["evictions"] > 0, name
        assert counts["hits"] > 0, name
        assert counts["events"]["activation_evicted"] == counts["evictions"], name
        assert counts["misses"]["evicted"] > 0, name
        assert list(found["stages"]) == [f"stage-{i}" for i in range(4)], name
        assert found["checkpoints"][-1][0] == len(requests), name
    for capacity in EXCERPT_CAPACITIES:
        lru = golden["scenarios"][f"paged-lru@{capacity}"]
        reuse = golden["scenarios"][f"paged-reuse@{capacity}"]
        assert lru["digest"] != reuse["digest"]


def test_scenario_names_key_the_golden_documents() -> None:
    """Names read as policy@capacity; the scenario rebuilds from its JSON form."""
    chosen = scenarios([1000, 0], stages=2)
    assert [s.name for s in chosen] == [
        "ladder@1000",
        "paged-lru@1000",
        "paged-reuse@1000",
        "ladder@0",
        "paged-lru@0",
        "paged-reuse@0",
    ]
    assert Scenario(**chosen[2].as_dict()) == chosen[2]
    config = chosen[2].sim_config()
    assert (config.stages, str(config.index), config.page_eviction) == (2, "paged", "reuse")
    assert config.capacity_tokens == 1000


def test_compare_is_silent_on_equal_documents_and_names_what_differs() -> None:
    """A difference names the scenario, the stage and part, the counts (golden, then now) and
    the request window where the running digests first part."""
    golden = _golden()
    assert compare(golden, copy.deepcopy(golden)) == []
    now = copy.deepcopy(golden)
    changed = now["scenarios"]["paged-lru@111000"]
    changed["digest"] = "0" * 64
    changed["stages"]["stage-2"]["events"] = "1" * 64
    changed["counts"]["events"]["activation_evicted"] += 1
    changed["checkpoints"][3][1] = "f" * 16
    lines = compare(golden, now)
    assert lines[0].startswith("paged-lru@111000: digest golden ")
    assert "paged-lru@111000: stage-2 events differ" in lines
    old = golden["scenarios"]["paged-lru@111000"]["counts"]["events"]["activation_evicted"]
    assert f"paged-lru@111000: counts.events.activation_evicted: golden {old}, now {old + 1}" in (
        lines
    )
    first, last = golden["scenarios"]["paged-lru@111000"]["checkpoints"][2:4]
    assert lines[-1] == f"paged-lru@111000: first differs within requests {first[0] + 1}..{last[0]}"
    assert all(line.startswith("paged-lru@111000: ") for line in lines)


def test_compare_refuses_another_trace_before_any_scenario() -> None:
    """Fingerprints of another trace (or layout) are not compared scenario by scenario."""
    golden = _golden()
    other = {**golden, "trace_digest": "0" * 64, "scenarios": {}}
    assert compare(golden, other) == [
        f"trace_digest: golden {golden['trace_digest']!r}, now {'0' * 64!r}"
    ]
    missing = {**golden, "scenarios": dict(list(golden["scenarios"].items())[1:])}
    assert compare(golden, missing) == ["ladder@111000: not fingerprinted now"]
    assert compare(missing, golden) == ["ladder@111000: no golden fingerprint"]


def test_the_trace_digest_changes_with_any_block() -> None:
    """Golden data of one trace is never compared with another trace's fingerprints."""
    requests = [SimRequest(index=0, input_length=700, block_ids=(1, 2))]
    other = [SimRequest(index=0, input_length=700, block_ids=(1, 3))]
    assert trace_digest(requests) != trace_digest(other)
    document = golden_document("t", requests, [])
    assert document["requests"] == 1
    assert document["prompt_tokens"] == 700
    assert document["scenarios"] == {}


def test_paged_key_digests_are_hashed_as_their_rank_and_ladder_names_as_they_are() -> None:
    """Format 2: a paged entry's key digest counts by which entry it is, not by its bytes; the
    same digest gets the same rank all along a stream; the ladder's names are untouched."""
    ranks: dict[str, int] = {}
    first = (
        b'{"page_id":"act:s:0:0:w8:page:0+512:0123456789abcdef",'
        b'"key":"act:s:0:0:w8:tail:512+3:fedcba9876543210"}\n'
    )
    again = b'{"page_id":"act:s:0:0:w8:page:0+512:0123456789abcdef"}\n'
    ladder = b'{"page_id":"act:s:0:512:0:0123456789abcdef:w8"}\n'
    assert _ranked_names(first, ranks) == (
        b'{"page_id":"act:s:0:0:w8:page:0+512:#0","key":"act:s:0:0:w8:tail:512+3:#1"}\n'
    )
    assert _ranked_names(again, ranks) == b'{"page_id":"act:s:0:0:w8:page:0+512:#0"}\n'
    assert _ranked_names(ladder, ranks) == ladder
    renamed = first.replace(b"0123456789abcdef", b"aaaaaaaaaaaaaaaa")
    assert _ranked_names(renamed, {}) == _ranked_names(first, {})
    merged = first.replace(b"fedcba9876543210", b"0123456789abcdef")  # two entries made one
    assert _ranked_names(merged, {}) != _ranked_names(first, {})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give a trace path or --excerpt (one of them)"),
        (["--excerpt", "TRACE"], "give a trace path or --excerpt (one of them)"),
        (["/no/such/trace.jsonl"], "cannot read trace /no/such/trace.jsonl: no such file"),
        (["--excerpt", "--write", "--only", "ladder@111000"], "--only is for checking"),
        (["--excerpt", "--capacity", "5"], "--capacity picks what --write fingerprints"),
        (["--excerpt", "--only", "ladder@5"], "--only must name scenarios among ladder@111000"),
        (["--excerpt", "--golden", "NOWHERE"], "no golden file"),
        (["--excerpt", "--workers", "0"], "--workers: must be an integer >= 1, got 0"),
    ],
)
def test_check_golden_refuses_bad_arguments_in_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Usage errors exit 2 before any replay, and write nothing."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("", encoding="utf-8")
    replaced = {"TRACE": str(trace), "NOWHERE": str(tmp_path / "nowhere.json")}
    with pytest.raises(SystemExit) as caught:
        load_script("check_golden").main([replaced.get(arg, arg) for arg in argv])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert ": error: " in err.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == [trace]


_TINY = """
import json, sys
import structlog
from stage_runtime.sim import SimRequest
from tests.stage_runtime.golden.fingerprint import FingerprintError, Scenario, fingerprint

requests = [
    SimRequest(index=i, input_length=length, block_ids=tuple(ids))
    for i, (length, ids) in enumerate(
        [(1500, [1, 2, 3]), (1100, [1, 2, 4]), (1500, [1, 2, 3]), (1500, [5, 6, 7])]
    )
]
scenario = Scenario(index=sys.argv[1], page_eviction="lru", capacity_tokens=2048, stages=2)
first = fingerprint(requests, scenario, dump=sys.argv[2])
again = fingerprint(requests, scenario)
structlog.configure(cache_logger_on_first_use=True)
structlog.get_logger("stage_runtime.cache_actor").bind()  # caches nothing: not a module's
import stage_runtime.cache_actor as actor_module
actor_module.log.bind()  # the module's own logger, cached now
try:
    fingerprint(requests, scenario)
    refused = ""
except FingerprintError as exc:
    refused = str(exc)
print(json.dumps({"first": first, "again": again, "refused": refused}))
"""


@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_a_fingerprint_is_deterministic_dumps_what_it_hashes_and_refuses_cached_loggers(
    index: str, tmp_path: Path
) -> None:
    """Two fingerprints of the same replay are equal; the dump holds one line per hashed item;
    a library logger cached on first use (whose events a capture would miss) is refused."""
    dump = tmp_path / "dump.txt"
    done = subprocess.run(
        [sys.executable, "-c", _TINY, index, str(dump)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    first, again = result["first"], result["again"]
    assert first == again
    counts = first["counts"]
    assert counts["hits"] == 2 * 2  # requests 1 and 2 restore a prefix, at both stages
    assert counts["evictions"] > 0  # 2,048 tokens hold less than the four prompts
    events = sum(counts["events"].values())
    lines = dump.read_text(encoding="utf-8").splitlines()
    # events, one report per request and stage, and one statistics line per stage
    assert len(lines) == events + 4 * 2 + 2
    assert {line.split(" ")[1] for line in lines} == {"events", "reports", "statistics"}
    assert lines[0].startswith("stage-0 events {")
    assert "stage_runtime.cache_actor.log" in result["refused"]
