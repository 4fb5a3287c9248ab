"""Behaviour fingerprints of the stage caches: what a replay restored, recorded, evicted and logged.

A fingerprint replays a trace through the real pipeline (the simulator's stages and models,
:func:`~stage_runtime.pipeline.open_pipeline`, one request at a time in file order, as
``stage-runtime replay`` does at concurrency 1) and reduces everything the caches did to
SHA-256 digests, stage by stage, in three parts:

- ``events``: every cache log event (``activation_restored``, ``activation_missed``,
  ``activation_recorded``, ``activation_evicted``; any ``activation_*`` event) with its level
  and keys, in the order the stage's cache logged them;
- ``reports``: each request's report from the stage: tokens restored and computed, every record
  (its key, sizes, counts) and every entry each record evicted;
- ``statistics``: the stage cache's counters and accounting at the end of the replay.

Each item is one line of canonical JSON (sorted keys, no spaces). Nothing that varies between
two runs of the same code is hashed: no times (wall or virtual), no object ids, no mailbox
statistics, no actor names. Next to the digests, a few counts (events by name, hits, records,
evictions, misses by reason) and running digests at a few request boundaries (``checkpoints``)
say what changed and from where, when a digest does.

The golden data (``tests/stage_runtime/golden/excerpt.json`` for the bundled excerpt,
``benchmarks/golden/<trace>.json`` for a full trace) was taken from the code before the cache
refactor of issue 20. Format 2 was written by the code at 629e94a, whose format-1 fingerprints
still equalled those golden ones; it differs only in ranking paged key digests
(:func:`_ranked_names`), and its ladder digests are the format-1 ones. If a refactor renames the
API this module reads (a report's field, ``Pipeline.stats``), adapt the reading here, never the
golden data: a fingerprint that changes is a behaviour that changed.

Structlog loggers cached on first use (``cache_logger_on_first_use=True``) no longer see a
reconfiguration, so their events could not be captured: :func:`fingerprint` refuses to run
when one exists. Compute fingerprints in a fresh process (``benchmarks/check_golden.py``).
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import IO, Any, Final

import attrs
import numpy as np
import structlog
import trio
import trio.testing

from stage_runtime import StageConfig, open_pipeline
from stage_runtime.sim import (
    BlockTokenizer,
    SimConfig,
    SimRequest,
    simulated_model_factory,
    stage_configs,
    validate_requests,
)

__all__ = [
    "EXCERPT_CAPACITIES",
    "FORMAT",
    "POLICIES",
    "TRACE_CAPACITIES",
    "FingerprintError",
    "Scenario",
    "compare",
    "fingerprint",
    "golden_document",
    "scenarios",
    "trace_digest",
]

FORMAT: Final = 2
"""Version of the fingerprint's layout; golden data of another version cannot be compared.
Format 2 hashes each paged entry's key digest in its name as its rank of first appearance in
the stream (:func:`_ranked_names`)."""

_PAGED_NAME: Final = re.compile(r"(:(?:page|tail|exact):\d+\+\d+:)([0-9a-f]{16})(?![0-9a-f])")
"""The key digest in a paged entry's name (``act:...:page:512+512:<16 hex>``)."""

POLICIES: Final = (("ladder", "lru"), ("paged", "lru"), ("paged", "reuse"))
"""The cache policies fingerprinted: ``(index, page_eviction)``."""

TRACE_CAPACITIES: Final = (1_000_000, 3_000_000)
"""Per-stage capacities (tokens) of the full synthetic trace's fingerprints (issue 20)."""

EXCERPT_CAPACITIES: Final = (111_000, 333_000)
"""The same capacities scaled to the bundled excerpt: it holds 6.80M of the full trace's 61.19M
prompt tokens (1/9), so 1M and 3M become 111K and 333K. Every policy evicts at both."""

CHECKPOINTS: Final = 8
"""Running digests taken at this many request boundaries (evenly spaced, the last one at the
end): the first that differs from the golden one bounds where behaviour first changed."""

_DROPPED_EVENT_KEYS: Final = frozenset({"event", "stage", "actor", "timestamp"})
"""Event keys not hashed as keys: the name (hashed as ``event``), the stage (it picks the
stream), the actor's name (an implementation detail) and any time stamp."""

_RECORD_FIELDS: Final = (
    "page_id",
    "token_count",
    "payload_bytes",
    "evicted_entries",
    "evicted_bytes",
    "entries",
    "resident_bytes",
)
_EVICTED_FIELDS: Final = (
    "key",
    "token_count",
    "payload_bytes",
    "reason",
    "entries_after",
    "resident_bytes_after",
)
_COUNTER_FIELDS: Final = (
    "entries",
    "resident_bytes",
    "lookups",
    "hits",
    "misses",
    "records",
    "evictions",
    "evicted_bytes",
)
_ACCOUNTING_FIELDS: Final = (
    "index",
    "lookups",
    "hits",
    "misses_never_seen",
    "misses_evicted",
    "misses_rejected",
    "restored_tokens",
    "entries",
    "resident_bytes",
    "unique_prefix_bytes",
    "evictions",
    "evicted_bytes",
)
_PARTS: Final = ("events", "reports", "statistics")


class FingerprintError(Exception):
    """A fingerprint cannot be taken (cached loggers) or read (an API it reads has changed)."""


@attrs.frozen(kw_only=True)
class Scenario:
    """One replay to fingerprint: a cache policy at a capacity."""

    index: str
    """``"ladder"`` or ``"paged"``."""

    page_eviction: str = "lru"
    """``"lru"`` or ``"reuse"`` (paged only; the ladder's is always LRU)."""

    capacity_tokens: int
    """Per-stage capacity in tokens (``0``: unbounded)."""

    stages: int = 4
    """Pipeline stages."""

    @property
    def name(self) -> str:
        """``ladder@1000000``, ``paged-reuse@3000000``: the key in a golden document."""
        policy = self.index if self.index == "ladder" else f"{self.index}-{self.page_eviction}"
        return f"{policy}@{self.capacity_tokens}"

    def as_dict(self) -> dict[str, Any]:
        """The scenario as JSON-ready values."""
        return attrs.asdict(self)

    def sim_config(self) -> SimConfig:
        """The simulator's settings: its defaults (the CLI's) but for these four."""
        return SimConfig(
            stages=self.stages,
            index=self.index,
            page_eviction=self.page_eviction,
            capacity_tokens=self.capacity_tokens,
        )


def scenarios(capacities: Sequence[int], *, stages: int = 4) -> list[Scenario]:
    """Every policy of :data:`POLICIES` at every capacity, capacity by capacity."""
    return [
        Scenario(index=index, page_eviction=eviction, capacity_tokens=capacity, stages=stages)
        for capacity in capacities
        for index, eviction in POLICIES
    ]


def _plain(value: object) -> object:
    """JSON for what ``json`` does not know: numpy scalars, enums and attrs instances."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, enum.Enum):
        return value.value
    if attrs.has(type(value)):
        return attrs.asdict(value)  # type: ignore[arg-type]
    msg = f"cannot fingerprint a {type(value).__name__}: {value!r}"
    raise FingerprintError(msg)


def _canonical(item: object) -> bytes:
    return (
        json.dumps(item, sort_keys=True, separators=(",", ":"), default=_plain, allow_nan=False)
        + "\n"
    ).encode()


def _ranked_names(line: bytes, ranks: dict[str, int]) -> bytes:
    """``line`` with the key digest in each paged entry name replaced by ``#`` and its rank of
    first appearance in ``ranks`` (the stream's, filled as it goes).

    Which entries a replay names, and which names are the same entry, is behaviour; the bytes
    of a paged key are not: they depend on how keys are derived, which changed once (issue 20:
    the token part of a key is computed once per request for every stage). The ladder's names
    are the spec's and are hashed as they are."""
    if b":page:" not in line and b":tail:" not in line and b":exact:" not in line:
        return line

    def rank(found: re.Match[str]) -> str:
        digest = found.group(2)
        number = ranks.setdefault(digest, len(ranks))
        return f"{found.group(1)}#{number}"

    return _PAGED_NAME.sub(rank, line.decode()).encode()


class _Stream:
    """SHA-256 over canonical JSON lines (optionally copied to a dump file)."""

    __slots__ = ("_dump", "_hash", "_label", "_ranks", "items")

    def __init__(self, label: str, dump: IO[str] | None) -> None:
        self._hash = hashlib.sha256()
        self._label = label
        self._dump = dump
        self._ranks: dict[str, int] = {}
        self.items = 0

    def add(self, item: object) -> None:
        line = _ranked_names(_canonical(item), self._ranks)
        self._hash.update(line)
        self.items += 1
        if self._dump is not None:
            self._dump.write(f"{self._label} {line.decode()}")

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _fields(obj: object, names: Sequence[str], what: str) -> dict[str, Any]:
    try:
        return {name: getattr(obj, name) for name in names}
    except AttributeError as exc:
        msg = (
            f"{what} has no {exc.name!r} any more: adapt {__name__} to the new API "
            "(never the golden data)"
        )
        raise FingerprintError(msg) from exc


def _report_item(request: SimRequest, report: object) -> dict[str, Any]:
    records: Sequence[object] = _fields(report, ("records",), "a stage's report")["records"]
    evicted: Sequence[object] = _fields(report, ("evicted",), "a stage's report")["evicted"]
    return {
        "request": request.index,
        **_fields(report, ("restored_tokens", "computed_tokens"), "a stage's report"),
        "records": [
            {
                **_fields(record, _RECORD_FIELDS, "a record"),
                "evicted": [
                    _fields(entry, _EVICTED_FIELDS, "an evicted entry")
                    for entry in _fields(record, ("evicted",), "a record")["evicted"]
                ],
            }
            for record in records
        ],
        "evicted": len(evicted),
    }


def _statistics_item(stage: object) -> dict[str, Any] | None:
    cache = _fields(stage, ("cache",), "a stage's statistics")["cache"]
    if cache is None:
        return None
    accounting = _fields(cache, ("accounting",), "a cache's statistics")["accounting"]
    return {
        **_fields(cache, _COUNTER_FIELDS, "a cache's statistics"),
        "accounting": _fields(accounting, _ACCOUNTING_FIELDS, "a cache's accounting"),
    }


def _cached_loggers() -> list[str]:
    """Module loggers of the library that structlog cached on first use (they would log past
    any capture: their processors were fixed when they were cached)."""
    cached = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("stage_runtime", "actors")):
            continue
        for attribute, value in list(vars(module).items()):
            if isinstance(value, structlog._config.BoundLoggerLazyProxy) and "bind" in vars(value):
                cached.append(f"{name}.{attribute}")
    return cached


@contextlib.contextmanager
def _events_to(sink: Callable[[str, MutableMapping[str, Any]], None]) -> Iterator[None]:
    """Send every structlog event of every level (contextvars merged) to ``sink(level, event)``
    instead of any output, restoring the configuration afterwards."""
    cached = _cached_loggers()
    if cached:
        msg = (
            f"structlog cached these loggers on first use, so their events cannot be captured: "
            f"{', '.join(sorted(cached))}; take fingerprints in a fresh process"
        )
        raise FingerprintError(msg)

    def capture(
        logger: object, method: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        sink(method, event)
        raise structlog.DropEvent

    saved = structlog.get_config()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, capture],
        wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
        cache_logger_on_first_use=False,
    )
    try:
        yield
    finally:
        structlog.configure(**saved)


def _checkpoint_positions(requests: int) -> set[int]:
    """Request counts after which a checkpoint is taken (the last one: all of them)."""
    if requests == 0:
        return set()
    return {max(1, math.ceil(requests * k / CHECKPOINTS)) for k in range(1, CHECKPOINTS + 1)}


class _Recorder:
    """Everything one replay's caches did, folded into streams as it happens."""

    def __init__(self, stage_ids: Sequence[str], requests: int, dump: IO[str] | None) -> None:
        self.stage_ids = list(stage_ids)
        self.streams = {
            (stage, part): _Stream(f"{stage} {part}", dump)
            for stage in stage_ids
            for part in _PARTS
        }
        self.pending: dict[str, list[dict[str, Any]]] = {stage: [] for stage in stage_ids}
        """Events logged since the last request finished, by stage."""
        self.events: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.checkpoints: list[list[object]] = []
        self.done = 0
        self._at = _checkpoint_positions(requests)

    def event(self, level: str, event: MutableMapping[str, Any]) -> None:
        """Keep a cache event (any ``activation_*`` one) for its stage's stream."""
        name = str(event.get("event"))
        if not name.startswith("activation_"):
            return
        self.events[name] += 1
        item = {key: value for key, value in event.items() if key not in _DROPPED_EVENT_KEYS}
        item["event"] = name
        item["level"] = level
        self.pending.setdefault(str(event.get("stage")), []).append(item)

    def flush(self) -> None:
        """Hash the events kept so far (a stream's digest does not depend on when)."""
        for stage, events in self.pending.items():
            if stage not in self.stage_ids:
                msg = f"cache events without a stage of this pipeline: stage={stage!r}"
                raise FingerprintError(msg)
            stream = self.streams[stage, "events"]
            for item in events:
                stream.add(item)
            events.clear()

    def finished(self, request: SimRequest, reports: Sequence[object]) -> None:
        """Hash a finished request's events and reports; take a checkpoint when one is due."""
        self.flush()
        if len(reports) != len(self.stage_ids):
            msg = (
                f"request {request.index}: {len(reports)} stage reports, "
                f"expected {len(self.stage_ids)}"
            )
            raise FingerprintError(msg)
        counts = self.counts
        for stage, report in zip(self.stage_ids, reports, strict=True):
            item = _report_item(request, report)
            self.streams[stage, "reports"].add(item)
            counts["hits"] += bool(item["restored_tokens"])
            counts["restored_tokens"] += item["restored_tokens"]
            counts["computed_tokens"] += item["computed_tokens"]
            for record in item["records"]:
                counts["records"] += 1
                counts["evictions"] += len(record["evicted"])
                counts["evicted_bytes"] += sum(e["payload_bytes"] for e in record["evicted"])
        self.done += 1
        if self.done in self._at:
            self.checkpoints.append([self.done, _combined(self.streams)[:16]])

    def statistics(self, stages: Sequence[object]) -> None:
        """Hash each stage's final cache statistics."""
        if len(stages) != len(self.stage_ids):
            msg = f"{len(stages)} stages' statistics, expected {len(self.stage_ids)}"
            raise FingerprintError(msg)
        for stage, statistics in zip(self.stage_ids, stages, strict=True):
            item = _statistics_item(statistics)
            self.streams[stage, "statistics"].add(item)
            if item is not None:
                for reason in ("never_seen", "evicted", "rejected"):
                    self.misses[reason] += item["accounting"][f"misses_{reason}"]

    def result(self, scenario: Scenario, requests: int) -> dict[str, Any]:
        """The fingerprint (see :func:`fingerprint`)."""
        streams = self.streams
        return {
            "scenario": scenario.as_dict(),
            "requests": requests,
            "digest": _combined(streams),
            "stages": {
                stage: {part: streams[stage, part].hexdigest() for part in _PARTS}
                for stage in self.stage_ids
            },
            "checkpoints": self.checkpoints,
            "counts": {
                "events": dict(sorted(self.events.items())),
                **{key: self.counts[key] for key in sorted(self.counts)},
                "misses": dict(sorted(self.misses.items())),
            },
        }


def fingerprint(
    requests: Sequence[SimRequest],
    scenario: Scenario,
    *,
    dump: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Replay ``requests`` with ``scenario``'s cache and fingerprint what every cache did.

    Args:
        requests: The workload, in file order (replayed one at a time in that order).
        scenario: The policy, capacity and stages.
        dump: A file to write every hashed item to, one line ``<stage> <part> <json>`` each
            (to diff two versions of the code item by item); nothing is written when None.

    Returns:
        JSON-ready: ``scenario``, ``requests``, ``digest`` (over every stage and part),
        ``stages`` (a digest per stage and part), ``checkpoints`` (``[requests done, digest]``)
        and ``counts``.

    Raises:
        FingerprintError: a library logger was cached on first use, or the API this module
            reads has changed.
        ConfigError: the requests cannot be replayed.
    """
    config = scenario.sim_config()
    validate_requests(requests, block_size=config.block_size)
    configs = stage_configs(config)
    with contextlib.ExitStack() as files:
        handle = None if dump is None else files.enter_context(open(dump, "w", encoding="utf-8"))
        recorder = _Recorder([stage.stage_id for stage in configs], len(requests), handle)
        _replay(requests, config, configs, recorder)
    return recorder.result(scenario, len(requests))


def _replay(
    requests: Sequence[SimRequest],
    config: SimConfig,
    configs: Sequence[StageConfig],
    recorder: _Recorder,
) -> None:
    """Replay ``requests`` one at a time through a pipeline of ``configs``, into ``recorder``."""

    async def run() -> list[object]:
        factory = simulated_model_factory(
            bytes_per_token=config.bytes_per_token, cost=config.cost, sleep=False
        )
        tokenizer = BlockTokenizer(config.block_size)
        # environ={}: the cache is what the scenario says, whatever STAGE_RUNTIME_KV_CACHE*
        # this process was started with (as the simulator does).
        async with open_pipeline(configs, factory, environ={}) as pipeline:
            for request in requests:
                result = await pipeline.prefill(
                    tokenizer.request_tokens(request),
                    session_id=f"session-{request.index}",
                    request_id=f"request-{request.index}",
                )
                recorder.finished(request, result.stages)
            final = await pipeline.statistics()
        return list(final.stages)

    with _events_to(recorder.event):
        stages = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
        recorder.flush()  # (nothing is expected after the last request; anything still counts)
    recorder.statistics(stages)


def _combined(streams: Mapping[tuple[str, str], _Stream]) -> str:
    """One digest over every stream's running digest, in stage and part order."""
    combined = hashlib.sha256()
    for (stage, part), stream in streams.items():
        combined.update(f"{stage} {part} {stream.items} {stream.hexdigest()}\n".encode())
    return combined.hexdigest()


def trace_digest(requests: Sequence[SimRequest]) -> str:
    """SHA-256 of what a replay reads of the requests (index, length, blocks, block lengths)."""
    digest = hashlib.sha256()
    for request in requests:
        digest.update(
            _canonical(
                [request.index, request.input_length, request.block_ids, request.block_lengths]
            )
        )
    return digest.hexdigest()


def golden_document(
    trace: str, requests: Sequence[SimRequest], fingerprints: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """A golden file's contents: the trace's identity and one fingerprint per scenario."""
    return {
        "format": FORMAT,
        "trace": trace,
        "trace_digest": trace_digest(requests),
        "requests": len(requests),
        "prompt_tokens": sum(request.input_length for request in requests),
        "scenarios": {Scenario(**found["scenario"]).name: dict(found) for found in fingerprints},
    }


def compare(golden: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """The differences between two golden documents, one line each (empty when equal).

    For each scenario that differs: its digest, then the stages and parts whose digests differ,
    the counts that differ (golden, then now) and the request window where the running
    digests first part.
    """
    lines: list[str] = []
    for key in ("format", "trace_digest", "requests", "prompt_tokens"):
        if golden.get(key) != actual.get(key):
            lines.append(f"{key}: golden {golden.get(key)!r}, now {actual.get(key)!r}")
    if lines:
        return lines  # not the same trace or layout: the rest cannot be compared
    wanted, got = golden.get("scenarios", {}), actual.get("scenarios", {})
    for name in sorted(set(wanted) | set(got)):
        if name not in got:
            lines.append(f"{name}: not fingerprinted now")
            continue
        if name not in wanted:
            lines.append(f"{name}: no golden fingerprint")
            continue
        lines += _compare_scenario(name, wanted[name], got[name])
    return lines


def _compare_scenario(name: str, golden: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    if golden == now:
        return []
    lines = [f"{name}: digest golden {golden['digest'][:16]}, now {now['digest'][:16]}"]
    for stage, parts in golden.get("stages", {}).items():
        for part, digest in parts.items():
            if now.get("stages", {}).get(stage, {}).get(part) != digest:
                lines.append(f"{name}: {stage} {part} differ")
    lines += [
        f"{name}: {path}: golden {old!r}, now {new!r}"
        for path, old, new in _leaf_differences("counts", golden["counts"], now["counts"])
    ]
    previous = 0
    for (done, old), (_, new) in zip(golden["checkpoints"], now["checkpoints"], strict=False):
        if old != new:
            lines.append(f"{name}: first differs within requests {previous + 1}..{done}")
            break
        previous = done
    return lines


def _leaf_differences(path: str, old: object, new: object) -> Iterator[tuple[str, object, object]]:
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for key in sorted(set(old) | set(new)):
            yield from _leaf_differences(f"{path}.{key}", old.get(key), new.get(key))
    elif old != new:
        yield path, old, new
