"""Reading Mooncake-format traces: valid lines, every malformed line, skipping, limits."""

from __future__ import annotations

import gzip
import io
import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stage_runtime import ConfigError, TraceFormatError
from stage_runtime.sim import (
    SimRequest,
    parse_trace_line,
    read_demo_trace,
    read_trace,
    trace_file_lines,
)
from stage_runtime.sim import trace as trace_module


def _line(**fields: object) -> str:
    record: dict[str, object] = {
        "timestamp": 1500,
        "input_length": 600,
        "output_length": 7,
        "hash_ids": [4, 5],
    }
    record.update(fields)
    return json.dumps({k: v for k, v in record.items() if v is not _MISSING})


_MISSING = object()


def test_valid_line_becomes_a_request() -> None:
    """A valid line keeps its lengths and ids, and the timestamp becomes seconds."""
    request = parse_trace_line(_line(), path="t.jsonl", line=3, index=2)
    assert request == SimRequest(
        index=2, line=3, arrival_s=1.5, input_length=600, output_length=7, block_ids=(4, 5)
    )


def test_block_layout_cuts_the_last_block() -> None:
    """Trace blocks are full except the last, which holds the rest of the prompt."""
    request = parse_trace_line(_line(hash_ids=[4, 5, 6]))
    assert request.block_layout(512) == [(4, 512), (5, 88)]


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        (
            "{not json",
            "",
            "is not valid JSON (expecting property name enclosed in double quotes at column 2)",
        ),
        (  # json's message ends in a dangling "at": the column is the position
            '{"timestamp": 0, "hash_ids": "a\tb"}',
            "",
            "is not valid JSON (a control character (U+0009) at column 32 inside a string: "
            "escape it, as \\u0009)",
        ),
        (  # "Unterminated string starting at", no position: where is it, and why?
            '{"timestamp": 0, "input_length": 600, "hash_ids": "1, 2]}',
            "",
            "is not valid JSON (the string opened at column 51 is not closed on this line)",
        ),
        (  # cut off mid-write, read with its line break: where it stops, not on the next line
            '{"timestamp": 1, "input_length": 1000\n',
            "",
            "is not valid JSON (expecting ',' delimiter at column 38)",
        ),
        (  # the same in a string: not closed, not a line break to escape
            '{"timestamp": 1, "hash_ids": "abc\r\n',
            "",
            "is not valid JSON (the string opened at column 30 is not closed on this line)",
        ),
        ("[1, 2]", "", "must be a JSON object, got list (a trace is JSON lines: one request"),
        # what json.loads raises besides JSONDecodeError
        (
            '{"timestamp": ' + "9" * 5000 + "}",
            "",
            "is not valid JSON (an integer of more than 4,300 digits)",
        ),
        ("[" * 100_000 + "]" * 100_000, "", "is not valid JSON (nested too deeply)"),
        (_line(timestamp=float("inf")), "timestamp", "must be a finite number of ms, got Infinity"),
        (_line(timestamp=10**400), "timestamp", "must be a finite number of ms, got 1000"),
        (_line(timestamp=float("nan")), "timestamp", "must be a finite number of ms, got NaN"),
        (
            _line(timestamp=-float("inf")),
            "timestamp",
            "must be a finite number of ms, got -Infinity",
        ),
        (_line(timestamp=-0.5), "timestamp", "must be >= 0, got -0.5"),
        (_line(timestamp=_MISSING), "timestamp", "timestamp is missing"),
        (_line(timestamp="soon"), "timestamp", 'must be a number of ms, got "soon"'),
        (_line(timestamp=-1), "timestamp", "must be >= 0, got -1"),
        (_line(input_length=_MISSING), "input_length", "input_length is missing"),
        (_line(input_length=-5), "input_length", "must be >= 1, got -5"),
        (_line(input_length=12.5), "input_length", "must be an integer, got 12.5"),
        (_line(input_length="600"), "input_length", 'must be an integer, got "600"'),
        (_line(input_length=True), "input_length", "must be an integer, got true"),
        # Values are quoted as the JSON file spells them, not as Python does (None, True).
        (_line(input_length=None), "input_length", "must be an integer, got null"),
        (_line(hash_ids=None), "hash_ids", "must be a list of integers, got null"),
        (_line(hash_ids={"a": 1}), "hash_ids", 'must be a list of integers, got {"a": 1}'),
        (_line(timestamp=False), "timestamp", "must be a number of ms, got false"),
        (_line(input_length=0), "input_length", "must be >= 1, got 0"),
        (_line(output_length=_MISSING), "output_length", "output_length is missing"),
        (_line(output_length=-2), "output_length", "must be >= 0, got -2"),
        # NaN is a float to json, never a length or an id
        (_line(input_length=float("nan")), "input_length", "must be an integer, got NaN"),
        (_line(output_length=float("nan")), "output_length", "must be an integer, got NaN"),
        (_line(hash_ids=[1, float("nan")]), "hash_ids", "got NaN at position 1"),
        (_line(hash_ids=_MISSING), "hash_ids", "hash_ids is missing"),
        (_line(hash_ids="1,2"), "hash_ids", "must be a list of integers"),
        (_line(hash_ids=[1, "x"]), "hash_ids", 'got "x" at position 1'),
        (  # a huge value is quoted cut short, not whole
            _line(hash_ids="x" * 100_000),
            "hash_ids",
            'must be a list of integers, got "xxxxxxxx',
        ),
        (_line(hash_ids=[1, 2**64]), "hash_ids", "must hold 64-bit integers"),
        (_line(hash_ids=[1, -(2**63) - 1]), "hash_ids", "must hold 64-bit integers"),
        (
            _line(input_length=1025, hash_ids=[1, 2]),
            "input_length",
            "must be <= block_size * len(hash_ids) = 512 * 2, got 1025",
        ),
        (_line(input_length=1, hash_ids=[]), "input_length", "512 * 0, got 1"),
        (  # json.loads keeps the last one silently: a line that says two things is refused
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2], '
            '"input_length": 900}',
            "input_length",
            "input_length appears twice in one object",
        ),
    ],
)
def test_malformed_line_names_file_line_and_field(text: str, field: str, fragment: str) -> None:
    """Every malformed line raises TraceFormatError naming the file, line and field."""
    with pytest.raises(TraceFormatError, match=r"^trace\.jsonl:7: ") as caught:
        parse_trace_line(text, path="trace.jsonl", line=7)
    assert fragment in str(caught.value)
    assert len(str(caught.value)) < 200
    assert (caught.value.path, caught.value.line, caught.value.field) == ("trace.jsonl", 7, field)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_float_timestamp_is_refused_for_what_is_wrong_with_it(timestamp: float) -> None:
    """Any float: a finite one >= 0 is an arrival in seconds; any NaN or infinity is named as
    not finite (whatever its sign), and only a finite negative one as below zero."""
    text = _line(timestamp=timestamp)
    if math.isfinite(timestamp) and timestamp >= 0:
        assert parse_trace_line(text).arrival_s == timestamp / 1000.0
        return
    with pytest.raises(TraceFormatError) as caught:
        parse_trace_line(text, path="t.jsonl", line=2)
    rule = "must be >= 0" if math.isfinite(timestamp) else "must be a finite number of ms"
    assert str(caught.value) == f"t.jsonl:2: timestamp {rule}, got {json.dumps(timestamp)}"


def test_a_byte_order_mark_before_the_first_line_is_ignored(tmp_path: Path) -> None:
    """Some editors start a UTF-8 file with a BOM; it is not part of the first JSON object."""
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (_line() + "\n" + _line() + "\n").encode())
    assert len(read_trace(path).requests) == 2
    with pytest.raises(TraceFormatError, match=r"trace\.jsonl:2: is not valid JSON"):
        parse_trace_line("\ufeff" + _line(), path="trace.jsonl", line=2)


def test_a_first_line_holding_only_a_byte_order_mark_is_blank(tmp_path: Path) -> None:
    """It was reported (and counted as skipped) as a line that is not valid JSON."""
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"\xef\xbb\xbf\r\n" + (_line() + "\n").encode())
    result = read_trace(path, skip_bad_lines=True)
    assert (len(result.requests), result.skipped_lines) == (1, 0)


def test_a_utf16_trace_is_named_as_such(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes((_line() + "\n").encode("utf-16"))
    with pytest.raises(TraceFormatError, match="it is UTF-16: convert it with iconv"):
        read_trace(path)


def test_block_size_sets_the_length_bound() -> None:
    """The input_length bound follows the block size."""
    assert (
        parse_trace_line(_line(input_length=20, hash_ids=[1, 2]), block_size=10).input_length == 20
    )
    with pytest.raises(TraceFormatError, match="10 \\* 2, got 21"):
        parse_trace_line(_line(input_length=21, hash_ids=[1, 2]), block_size=10)


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_read_trace_reports_the_line_number_of_the_bad_line(tmp_path: Path) -> None:
    """Line numbers count every line of the file, blank ones included."""
    path = _write(tmp_path, [_line(), "", _line(), _line(input_length=-1)])
    with pytest.raises(TraceFormatError) as caught:
        read_trace(path)
    assert caught.value.line == 4
    assert str(caught.value).startswith(f"{path}:4: input_length")


def test_skip_bad_lines_counts_and_keeps_the_good_ones(tmp_path: Path) -> None:
    """With skip_bad_lines, bad lines are counted and the valid ones replay in file order."""
    path = _write(tmp_path, [_line(), "oops", _line(output_length=1), _line(hash_ids=None)])
    result = read_trace(path, skip_bad_lines=True)
    assert result.skipped_lines == 2
    assert [r.line for r in result.requests] == [1, 3]
    assert [r.index for r in result.requests] == [0, 1]
    assert result.first_error is not None
    assert ":2:" in result.first_error


def test_limit_stops_after_that_many_requests(tmp_path: Path) -> None:
    """limit counts valid requests, and lines after the limit are not even parsed."""
    path = _write(tmp_path, [_line(), _line(), "not json at all"])
    result = read_trace(path, limit=2)
    assert len(result.requests) == 2
    assert result.skipped_lines == 0


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        # A block size of 0 used to blame the first line ("input_length must be <=
        # block_size * len(hash_ids) = 0 * 2"), None to raise a TypeError; a negative limit
        # read nothing without a word. Block sizes have SimConfig's bounds.
        ({"block_size": 0}, "block_size must be an integer in [4, 1,048,576], got 0"),
        ({"block_size": 3}, "block_size must be an integer in [4, 1,048,576], got 3"),
        ({"block_size": 2**20 + 1}, "block_size must be an integer in [4, 1,048,576], got 1048577"),
        ({"block_size": None}, "block_size must be an integer in [4, 1,048,576], got None"),
        ({"block_size": True}, "block_size must be an integer in [4, 1,048,576], got True"),
        ({"limit": -1}, "limit must be an integer >= 0, got -1"),
        ({"limit": "2"}, "limit must be an integer >= 0, got '2'"),
        ({"max_input_length": 0}, "max_input_length must be an integer >= 1, got 0"),
        ({"max_input_length": 1.5}, "max_input_length must be an integer >= 1, got 1.5"),
    ],
)
def test_bad_reading_arguments_are_config_errors_not_bad_lines(
    tmp_path: Path, arguments: dict[str, object], message: str
) -> None:
    """An argument out of range is the caller's error, named before any line is read."""
    path = _write(tmp_path, [_line(), _line()])
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_trace(path, **arguments)  # type: ignore[arg-type]
    assert len(read_trace(path, limit=0).requests) == 0


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"block_size": 0}, "block_size must be an integer in [4, 1,048,576], got 0"),
        ({"block_size": -1}, "block_size must be an integer in [4, 1,048,576], got -1"),
        ({"block_size": 1.5}, "block_size must be an integer in [4, 1,048,576], got 1.5"),
        ({"max_input_length": 0}, "max_input_length must be an integer >= 1, got 0"),
    ],
)
def test_a_bad_argument_to_parse_trace_line_is_not_blamed_on_the_line(
    arguments: dict[str, object], message: str
) -> None:
    """parse_trace_line checks its settings as read_trace does: a block size of 0 made a good
    line a TraceFormatError ("input_length must be <= block_size * len(hash_ids) = 0 * 2")."""
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        parse_trace_line(_line(), **arguments)  # type: ignore[arg-type]
    assert not isinstance(caught.value, TraceFormatError)


def test_non_utf8_file_is_a_trace_format_error(tmp_path: Path) -> None:
    """A binary file is refused as a trace error naming the file and the line."""
    path = tmp_path / "binary.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(TraceFormatError, match=r"binary\.jsonl:1: is not UTF-8") as caught:
        read_trace(path)
    assert caught.value.line == 1


def test_a_gzipped_trace_is_named_as_such(tmp_path: Path) -> None:
    """A compressed trace read as text gets the hint to decompress it into 'replay -'."""
    path = tmp_path / "trace.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"timestamp": 0}\n' * 50))
    with pytest.raises(TraceFormatError, match="it is gzip-compressed: zcat it into 'replay -'"):
        read_trace(path)


def test_skip_bad_lines_skips_a_non_utf8_line_and_keeps_the_rest(tmp_path: Path) -> None:
    """One undecodable line is one skipped line: the lines around it still replay."""
    path = tmp_path / "mixed.jsonl"
    good = _line().encode()
    path.write_bytes(good + b"\n" + b'{"timestamp": "\xe9t\xe9"}\n' + good + b"\n")
    result = read_trace(path, skip_bad_lines=True)
    assert [r.line for r in result.requests] == [1, 3]
    assert result.skipped_lines == 1
    assert result.first_error is not None
    assert "mixed.jsonl:2: is not UTF-8 text" in result.first_error


def test_bundled_demo_trace_has_300_requests_with_sharing() -> None:
    """The packaged excerpt loads through importlib.resources: 300 requests, 6.8M tokens."""
    result = read_demo_trace()
    assert len(result.requests) == 300
    assert sum(r.input_length for r in result.requests) == 6_801_604
    assert result.skipped_lines == 0


def test_unsigned_64_bit_hash_ids_parse() -> None:
    """A hash id up to 2**64 - 1 is a valid id."""
    assert parse_trace_line(_line(hash_ids=[2**64 - 1, 3])).block_ids == (2**64 - 1, 3)


def test_the_fast_path_reads_every_bundled_line_as_the_checked_path_does() -> None:
    """msgspec's reading of a line (the fast path) equals the standard library's, field by
    field, for each line of the bundled excerpt, as text and as bytes."""
    from stage_runtime.data import demo_trace
    from stage_runtime.sim.trace import _parse_checked, _parse_fast

    lines = demo_trace().read_bytes().splitlines()
    assert len(lines) == 300
    for number, raw in enumerate(lines, start=1):
        checked = _parse_checked(
            raw, path="t", line=number, index=number, block_size=512, max_input_length=None
        )
        for text in (raw, raw.decode()):
            fast = _parse_fast(
                text, line=number, index=number, block_size=512, max_input_length=None
            )
            assert fast == checked


@pytest.mark.parametrize(
    "text",
    [
        '{"timestamp": 1, "input_length": 2, "output_length": 0, "hash_ids": [1], "x": 1}',
        '{"timestamp": 1.5, "input_length": 2, "output_length": 0, "hash_ids": [1]}',
        '{"timestamp": 1e300, "input_length": 2, "output_length": 0, "hash_ids": [1]}',
        '{"timestamp": 1, "input_length": 2, "output_length": 1' + "0" * 30 + ', "hash_ids": [1]}',
        '{"timestamp": 1, "input_length": 2, "output_length": 0, "hash_ids": ['
        + str(-(2**63))
        + "]}",
        '{"timestamp": 1, "input_length": 2, "output_length": 0, "hash_ids": ['
        + str(2**64 - 1)
        + "]}",
        '{"timestamp": 1, "input_length": 2, "output_length": 0, "hash_ids": [1], "s": "a:b"}',
    ],
    ids=["extra-field", "float-ms", "huge-float-ms", "long-output", "id-min", "id-max", "colon"],
)
def test_lines_off_the_fast_path_read_as_before(text: str) -> None:
    """A valid line the fast path declines or takes (an extra field, a float timestamp, ids at
    the ends of the range, numbers past 64 bits) parses to the same request either way."""
    from stage_runtime.sim.trace import _parse_checked

    checked = _parse_checked(text, path="t", line=3, index=0, block_size=512, max_input_length=None)
    assert parse_trace_line(text, path="t", line=3) == checked
    assert parse_trace_line(text.encode(), path="t", line=3) == checked


@pytest.mark.parametrize("field", ["timestamp", "input_length", "output_length", "hash_ids"])
def test_a_repeated_key_is_refused_with_its_line_although_msgspec_keeps_the_last(
    field: str,
) -> None:
    """msgspec keeps the last of two equal keys: the repeat is still a TraceFormatError naming
    the file, the line and the field."""
    values = {"timestamp": "1", "input_length": "2", "output_length": "0", "hash_ids": "[1]"}
    body = ", ".join(f'"{key}": {value}' for key, value in values.items())
    text = "{" + body + f', "{field}": {values[field]}' + "}"
    with pytest.raises(TraceFormatError, match=f"^t.jsonl:7: {field} appears twice") as caught:
        parse_trace_line(text, path="t.jsonl", line=7)
    assert (caught.value.line, caught.value.field) == (7, field)


@pytest.mark.parametrize("skip_bad_lines", [False, True])
def test_a_line_over_the_limit_is_refused_as_it_is_read(
    skip_bad_lines: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line longer than MAX_TRACE_LINE_BYTES stops the read at that line, named, even when
    bad lines are skipped; the lines before it are read as usual."""
    monkeypatch.setattr(trace_module, "MAX_TRACE_LINE_BYTES", 200)
    path = tmp_path / "t.jsonl"
    path.write_text(_line() + "\n" + "[" + "1," * 150 + "1]\n" + _line() + "\n")
    assert len(_line()) <= 200
    with pytest.raises(TraceFormatError) as caught:
        read_trace(path, skip_bad_lines=skip_bad_lines)
    assert str(caught.value) == (
        f"{path}:2: is longer than 200 bytes: a trace line holds one request "
        "(is this a JSON lines file?)"
    )
    assert (caught.value.line, caught.value.field) == (2, "")
    lines = trace_file_lines(io.BytesIO(b"a\nbb\n" + b"c" * 300), path="x")
    assert [next(lines), next(lines)] == [b"a\n", b"bb\n"]
    with pytest.raises(TraceFormatError, match=r"^x:3: is longer than 200 bytes"):
        next(lines)


def test_a_line_of_the_limits_length_fits_with_its_break(monkeypatch: pytest.MonkeyPatch) -> None:
    """The limit counts what a line holds, not its line break (\n or \r\n), from binary and
    text handles alike."""
    monkeypatch.setattr(trace_module, "MAX_TRACE_LINE_BYTES", 8)
    data = b"12345678\n" + b"12345678\r\n" + b"12345678"
    assert list(trace_file_lines(io.BytesIO(data))) == [b"12345678\n", b"12345678\r\n", b"12345678"]
    assert list(trace_file_lines(io.StringIO(data.decode()))) == [
        "12345678\n",
        "12345678\r\n",
        "12345678",
    ]
    for longer in (b"123456789\n", b"123456789"):
        with pytest.raises(TraceFormatError, match=r"^<trace>:1: is longer than 8 bytes"):
            list(trace_file_lines(io.BytesIO(longer)))


def test_a_limited_read_stops_before_the_next_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading the first N requests reads no further line: one past them too long to read is
    not this read's concern."""
    monkeypatch.setattr(trace_module, "MAX_TRACE_LINE_BYTES", 200)
    path = tmp_path / "t.jsonl"
    path.write_text(_line() + "\n" + "[" + "1," * 150 + "1]\n")
    assert len(read_trace(path, limit=1).requests) == 1
    assert read_trace(path, limit=0).requests == ()
    with pytest.raises(TraceFormatError, match="is longer than 200 bytes"):
        read_trace(path, limit=2)
