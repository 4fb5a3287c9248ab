"""Requests to replay, and reading them from Mooncake-format trace files.

A trace line is one JSON object: ``timestamp`` (ms), ``input_length`` (tokens), ``output_length``
(tokens) and ``hash_ids`` (one id per block of the prompt; the last block may be partial). Equal
id chains mean equal prompt prefixes, which is all a replay needs to reproduce the sharing.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, AnyStr

import attrs
import msgspec

from stage_runtime._validators import check_int, is_int
from stage_runtime.config import _DuplicateKeyError, _unique_keys
from stage_runtime.errors import TraceFormatError, json_error_detail, shown_json
from stage_runtime.limits import MAX_BLOCK_SIZE, MAX_TRACE_LINE_BYTES, MIN_BLOCK_SIZE, U64_MAX

__all__ = [
    "SimRequest",
    "TraceReadResult",
    "parse_trace_line",
    "read_demo_trace",
    "read_trace",
    "read_trace_lines",
    "total_prompt_tokens",
]


def check_block_size(block_size: object) -> int:
    """``block_size`` as an ``int`` when it is a simulation block size: an integer in
    ``[MIN_BLOCK_SIZE, MAX_BLOCK_SIZE]`` (:mod:`stage_runtime.limits`), the bounds of
    ``SimConfig.block_size`` and ``--block-size``. Every function of the simulator that takes a
    block size checks it with this, before any work.

    Raises:
        ConfigError: ``"block_size must be an integer in [4, 1,048,576], got 0"``.
    """
    return check_int("block_size", block_size, low=MIN_BLOCK_SIZE, high=MAX_BLOCK_SIZE)


_ID_MIN = -(2**63)
"""Smallest hash id (int64); the largest is :data:`~stage_runtime.limits.U64_MAX`. The same
range msgspec decodes an ``int`` in, so the fast path below refuses what the slow one does."""


@attrs.frozen(kw_only=True)
class SimRequest:
    """One prompt to prefill: where it came from, when it arrives and which blocks it is made of."""

    index: int
    """Position in the workload (0-based, file order for a trace)."""

    line: int = 0
    """Line number in the trace file (1-based), or 0 for a synthetic request."""

    arrival_s: float = 0.0
    """Arrival time in seconds from the start of the workload (trace ``timestamp`` / 1000)."""

    input_length: int
    """Prompt length in tokens."""

    output_length: int = 0
    """Generated tokens (kept for the report; prefill does not use it)."""

    block_ids: tuple[int, ...]
    """One id per block of the prompt; equal ids at equal positions after equal chains are equal
    token blocks."""

    block_lengths: tuple[int, ...] | None = None
    """Tokens taken from each block, or ``None`` for full blocks with the last one cut so that the
    prompt has ``input_length`` tokens (the trace layout). Synthetic workloads use explicit lengths
    to place partial blocks (the end of a system prompt) in the middle of a prompt."""

    def block_layout(self, block_size: int) -> list[tuple[int, int]]:
        """Return ``(block_id, tokens_used)`` for every block the prompt actually uses."""
        if self.block_lengths is not None:
            return list(zip(self.block_ids, self.block_lengths, strict=True))
        used = -(-self.input_length // block_size)
        layout = [(block_id, block_size) for block_id in self.block_ids[:used]]
        if layout:
            last_id, _ = layout[-1]
            layout[-1] = (last_id, self.input_length - block_size * (used - 1))
        return layout


@attrs.frozen(kw_only=True)
class TraceReadResult:
    """The requests read from a trace and what was skipped on the way."""

    path: str
    """The file the requests came from (as given)."""

    requests: tuple[SimRequest, ...]
    """Valid requests in file order (at most ``limit`` of them)."""

    skipped_lines: int = 0
    """Malformed lines skipped because ``skip_bad_lines`` was set."""

    first_error: str | None = None
    """The message of the first skipped line, to show the user what was wrong."""


def _fail(path: str, line: int, field: str, rule: str) -> TraceFormatError:
    where = f"{path}:{line}"
    msg = f"{where}: {field} {rule}" if field else f"{where}: {rule}"
    return TraceFormatError(msg, path=path, line=line, field=field)


def _int_at_least(record: dict[str, object], field: str, minimum: int, path: str, line: int) -> int:
    if field not in record:
        raise _fail(path, line, field, "is missing")
    value = record[field]
    # bool is an int subclass in Python, but `true` is not a length.
    if not is_int(value):
        raise _fail(path, line, field, f"must be an integer, got {shown_json(value)}")
    if value < minimum:
        raise _fail(path, line, field, f"must be >= {minimum}, got {value}")
    return value


def parse_trace_line(
    text: str | bytes,
    *,
    path: str = "<trace>",
    line: int = 1,
    index: int = 0,
    block_size: int = 512,
    max_input_length: int | None = None,
) -> SimRequest:
    """Parse one trace line into a request, validating every field.

    Args:
        text: The JSON text of the line, or its raw bytes (decoded as UTF-8 here, so that an
            undecodable line is reported, and skippable, like any other malformed line).
        path: The file name used in error messages.
        line: The 1-based line number used in error messages.
        index: The request's position in the workload.
        block_size: Tokens per hash id; ``input_length`` may not exceed
            ``block_size * len(hash_ids)``.
        max_input_length: The longest prompt allowed (the stages' context); None: no limit.

    Returns:
        The request.

    Raises:
        TraceFormatError: The line is not UTF-8, not a JSON object, lacks a field, or has an
            invalid value; the message names the file, line and field.
        ConfigError: ``block_size`` is not an integer in ``[4, 1,048,576]`` or
            ``max_input_length`` is not None or an integer >= 1 (checked first: the line would
            otherwise be refused as if it were bad).
    """
    check_block_size(block_size)
    if max_input_length is not None:
        check_int("max_input_length", max_input_length, low=1)
    return _parse_line(
        text,
        path=path,
        line=line,
        index=index,
        block_size=block_size,
        max_input_length=max_input_length,
    )


def _parse_line(
    text: str | bytes,
    *,
    path: str,
    line: int,
    index: int,
    block_size: int,
    max_input_length: int | None,
) -> SimRequest:
    """:func:`parse_trace_line` once its settings are checked (a reader checks them once, not
    per line)."""
    if type(text) is bytes or type(text) is str:
        request = _parse_fast(
            text, line=line, index=index, block_size=block_size, max_input_length=max_input_length
        )
        if request is not None:
            return request
    return _parse_checked(
        text,
        path=path,
        line=line,
        index=index,
        block_size=block_size,
        max_input_length=max_input_length,
    )


class _TraceLine(msgspec.Struct):
    """The four fields of a trace line, as msgspec decodes them (strictly: ``true`` is not an
    ``int``, a string is not a number, an id outside int64..uint64 is refused)."""

    timestamp: int | float
    input_length: int
    output_length: int
    hash_ids: list[int]


_decode_line = msgspec.json.Decoder(_TraceLine).decode


def _parse_fast(
    text: str | bytes, *, line: int, index: int, block_size: int, max_input_length: int | None
) -> SimRequest | None:
    """The request of a well-formed line, or None for anything else: :func:`_parse_checked`
    then reads the line again and says what is wrong, in the same words as ever.

    msgspec keeps the last of two equal keys; a line whose text holds exactly four ``:`` and
    decodes to the four fields has each key once (a repeated key, an extra field or a colon
    inside a string all take the checked path, which refuses a repeated key).
    """
    colons = text.count(b":") if isinstance(text, bytes) else text.count(":")
    if colons != 4:
        return None
    try:
        record = _decode_line(text)
    except msgspec.MsgspecError:
        return None
    timestamp = record.timestamp
    input_length = record.input_length
    hash_ids = record.hash_ids
    # msgspec decodes integers of any size (even past int()'s 4,300 digits): anything beyond
    # 64 bits takes the checked path, which refuses or accepts it as it always has.
    if not (
        0 <= timestamp <= U64_MAX
        and 1 <= input_length <= U64_MAX
        and 0 <= record.output_length <= U64_MAX
        and input_length <= block_size * len(hash_ids)
        and (max_input_length is None or input_length <= max_input_length)
        and (not hash_ids or (min(hash_ids) >= _ID_MIN and max(hash_ids) <= U64_MAX))
    ):
        return None
    arrival_s = float(timestamp) / 1000.0
    return SimRequest(
        index=index,
        line=line,
        arrival_s=arrival_s,
        input_length=input_length,
        output_length=record.output_length,
        block_ids=tuple(hash_ids),
    )


def _parse_checked(
    text: str | bytes,
    *,
    path: str,
    line: int,
    index: int,
    block_size: int,
    max_input_length: int | None,
) -> SimRequest:
    """:func:`parse_trace_line` with the standard library's json, field by field: the path
    that names what is wrong with a line (and the one for lines the fast path declines)."""
    if isinstance(text, bytes):
        raw = text
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            rule = f"is not UTF-8 text ({exc.reason} at byte {exc.start})"
            if line == 1 and raw.startswith(b"\x1f\x8b"):
                rule += "; it is gzip-compressed: zcat it into 'replay -'"
            elif line == 1 and raw.startswith((b"\xff\xfe", b"\xfe\xff")):
                rule += "; it is UTF-16: convert it with iconv -f UTF-16 -t UTF-8"
            raise _fail(path, line, "", rule) from exc
    if line == 1 and text.startswith("\ufeff"):
        text = text[1:]  # a byte-order mark some editors write at the start of a file
    # Without its line break: parsed with it, a line cut off mid-write was said to break at
    # column 1 (of the next line), or to hold a control character to escape in its last string.
    text = text.rstrip("\r\n")
    try:
        record = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKeyError as exc:
        raise _fail(path, line, exc.key, "appears twice in one object") from None
    except json.JSONDecodeError as exc:
        rule = f"is not valid JSON ({json_error_detail(exc, one_line=True)})"
        raise _fail(path, line, "", rule) from exc
    except ValueError:  # an integer over int()'s 4,300 digits
        rule = "is not valid JSON (an integer of more than 4,300 digits)"
        raise _fail(path, line, "", rule) from None
    except RecursionError:
        raise _fail(path, line, "", "is not valid JSON (nested too deeply)") from None
    if not isinstance(record, dict):
        rule = f"must be a JSON object, got {type(record).__name__}"
        if isinstance(record, list):
            rule += " (a trace is JSON lines: one request object per line, not one array)"
        raise _fail(path, line, "", rule)

    if "timestamp" not in record:
        raise _fail(path, line, "timestamp", "is missing")
    timestamp = record["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
        raise _fail(path, line, "timestamp", f"must be a number of ms, got {shown_json(timestamp)}")
    # NaN, the infinities and an integer past a float's range are not finite; each is refused
    # as that, before the sign (NaN is not even >= 0, and -Infinity is not a time).
    try:
        arrival_s = float(timestamp) / 1000.0
    except OverflowError:
        arrival_s = math.inf
    if not math.isfinite(arrival_s):
        raise _fail(
            path, line, "timestamp", f"must be a finite number of ms, got {shown_json(timestamp)}"
        )
    if timestamp < 0:
        raise _fail(path, line, "timestamp", f"must be >= 0, got {shown_json(timestamp)}")

    input_length = _int_at_least(record, "input_length", 1, path, line)
    if max_input_length is not None and input_length > max_input_length:
        rule = f"must be <= {max_input_length:,} (the stages' context), got {input_length:,}"
        raise _fail(path, line, "input_length", rule)
    output_length = _int_at_least(record, "output_length", 0, path, line)

    if "hash_ids" not in record:
        raise _fail(path, line, "hash_ids", "is missing")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list):
        raise _fail(
            path, line, "hash_ids", f"must be a list of integers, got {shown_json(hash_ids)}"
        )
    for position, block_id in enumerate(hash_ids):
        if not is_int(block_id):
            rule = f"must hold integers, got {shown_json(block_id)} at position {position}"
            raise _fail(path, line, "hash_ids", rule)
        if not _ID_MIN <= block_id <= U64_MAX:
            rule = f"must hold 64-bit integers, got {shown_json(block_id)} at position {position}"
            raise _fail(path, line, "hash_ids", rule)
    if input_length > block_size * len(hash_ids):
        rule = (
            f"must be <= block_size * len(hash_ids) = {block_size} * {len(hash_ids)}, "
            f"got {input_length}"
        )
        raise _fail(path, line, "input_length", rule)

    return SimRequest(
        index=index,
        line=line,
        arrival_s=arrival_s,
        input_length=input_length,
        output_length=output_length,
        block_ids=tuple(hash_ids),
    )


def trace_file_lines(handle: IO[AnyStr], *, path: str = "<trace>") -> Iterator[AnyStr]:
    """The lines of an open trace file (binary or text), for :func:`read_trace_lines`, each
    read only when it holds at most :data:`~stage_runtime.limits.MAX_TRACE_LINE_BYTES` bytes
    (characters, from a text handle) besides its line break.

    Raises:
        TraceFormatError: a line is longer (``path`` and its number named), even where bad
            lines are skipped: such a file is no trace (``/dev/zero``, a binary file), and
            reading on would hold the line whole in memory.
    """
    limit = MAX_TRACE_LINE_BYTES
    number = 0
    # Up to two more: a line of the limit's length still fits with its break (\r\n at most).
    while line := handle.readline(limit + 2):
        number += 1
        if len(line) > limit and _content_length(line) > limit:
            rule = (
                f"is longer than {limit:,} bytes: a trace line holds one request "
                "(is this a JSON lines file?)"
            )
            raise _fail(path, number, "", rule)
        yield line


def _content_length(line: str | bytes) -> int:
    """``line``'s length without its line break (all of it when it has none)."""
    if isinstance(line, bytes):
        return len(line.rstrip(b"\r\n")) if line.endswith(b"\n") else len(line)
    return len(line.rstrip("\r\n")) if line.endswith("\n") else len(line)


def read_trace_lines(
    lines: Iterable[str | bytes],
    *,
    path: str = "<trace>",
    block_size: int = 512,
    skip_bad_lines: bool = False,
    limit: int | None = None,
    max_input_length: int | None = None,
) -> TraceReadResult:
    """Parse trace lines (blank lines are ignored).

    Args:
        lines: The lines of the trace, as text or as raw bytes (decoded line by line).
        path: The name used in error messages and in the result.
        block_size: Tokens per hash id.
        skip_bad_lines: Skip and count malformed lines instead of raising.
        limit: Stop after this many valid requests (``None``: read everything).
        max_input_length: The longest prompt allowed (the stages' context); None: no limit.

    Returns:
        The requests and the count of skipped lines.

    Raises:
        TraceFormatError: A line is malformed and ``skip_bad_lines`` is false.
        ConfigError: ``block_size``, ``limit`` or ``max_input_length`` is not an integer in
            range (``block_size`` in ``[4, 1,048,576]``; checked first: a block size of 0 would
            have every line refused, the first one named as if it were bad).
    """
    check_block_size(block_size)
    if limit is not None:
        check_int("limit", limit, low=0)
    if max_input_length is not None:
        check_int("max_input_length", max_input_length, low=1)
    requests: list[SimRequest] = []
    skipped = 0
    first_error: str | None = None
    if limit == 0:
        lines = ()
    for line_number, text in enumerate(lines, start=1):
        if not text.strip() or (line_number == 1 and text.strip() in ("\ufeff", b"\xef\xbb\xbf")):
            continue  # blank (a first line may hold just a byte-order mark)
        try:
            request = _parse_line(
                text,
                path=path,
                line=line_number,
                index=len(requests),
                block_size=block_size,
                max_input_length=max_input_length,
            )
        except TraceFormatError as exc:
            if not skip_bad_lines:
                raise
            skipped += 1
            if first_error is None:
                first_error = str(exc)
            continue
        requests.append(request)
        if limit is not None and len(requests) >= limit:
            break  # (before reading another line: one past the limit may be unreadable)
    return TraceReadResult(
        path=path, requests=tuple(requests), skipped_lines=skipped, first_error=first_error
    )


def read_trace(
    path: str | os.PathLike[str],
    *,
    block_size: int = 512,
    skip_bad_lines: bool = False,
    limit: int | None = None,
    max_input_length: int | None = None,
) -> TraceReadResult:
    """Read a Mooncake-format trace file (one JSON object per line).

    Args:
        path: The ``.jsonl`` file.
        block_size: Tokens per hash id.
        skip_bad_lines: Skip and count malformed lines instead of raising.
        limit: Stop after this many valid requests.
        max_input_length: The longest prompt allowed (the stages' context); None: no limit.

    Returns:
        The requests in file order and the count of skipped lines.

    Raises:
        TraceFormatError: A line is malformed (file, line and field in the message; a line that
            is not UTF-8 text is one) and ``skip_bad_lines`` is false.
        ConfigError: ``block_size``, ``limit`` or ``max_input_length`` is not an integer in
            range (``block_size`` in ``[4, 1,048,576]``).
        OSError: The file cannot be opened.
    """
    name = os.fspath(path)
    # Binary: each line is decoded on its own, so one bad byte costs one line, not the file.
    with Path(path).open("rb") as handle:
        return read_trace_lines(
            trace_file_lines(handle, path=name),
            path=name,
            block_size=block_size,
            skip_bad_lines=skip_bad_lines,
            limit=limit,
            max_input_length=max_input_length,
        )


def total_prompt_tokens(requests: Sequence[SimRequest]) -> int:
    """Sum of the prompt lengths."""
    return sum(request.input_length for request in requests)


def read_demo_trace(*, block_size: int = 512, limit: int | None = None) -> TraceReadResult:
    """Read the trace excerpt bundled with the package (see ``stage_runtime/data``).

    Args:
        block_size: Tokens per hash id.
        limit: Stop after this many requests.

    Returns:
        The excerpt's requests.

    Raises:
        ConfigError: ``block_size`` is not an integer in ``[4, 1,048,576]`` or ``limit`` is
            not None or an integer >= 0.
    """
    from stage_runtime.data import DEMO_TRACE, demo_trace

    with demo_trace().open("r", encoding="utf-8") as handle:
        return read_trace_lines(
            handle, path=f"stage_runtime/data/{DEMO_TRACE}", block_size=block_size, limit=limit
        )
