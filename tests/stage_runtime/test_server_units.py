"""Unit tests of the server's pure parts: tokenizer, request validation, Prometheus exposition."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys

import numpy as np
import numpy.typing as npt
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from stage_runtime.errors import ConfigError
from stage_runtime.server import (
    ByteTokenizer,
    InvalidRequestError,
    MetricFamily,
    MetricsExporter,
    Sample,
    ServerSettings,
    parse_prefill_request,
)
from stage_runtime.server.command import configure_logging


def _body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


# -- tokenizer ---------------------------------------------------------------------------------


def test_byte_tokenizer_maps_each_utf8_byte_to_its_value() -> None:
    """The text "hé" is the UTF-8 bytes 104, 195, 169."""
    tokens = ByteTokenizer().encode("hé")
    assert tokens.dtype == np.int32
    assert tokens.tolist() == [104, 195, 169]


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_text(text: str) -> None:
    """Decoding the tokens of any encodable text gives the text back."""
    tokenizer = ByteTokenizer()
    try:
        tokens = tokenizer.encode(text)
    except ConfigError:
        assert any(0xD800 <= ord(char) <= 0xDFFF for char in text)
        return
    assert tokenizer.decode(tokens) == text
    assert tokens.size == len(text.encode("utf-8"))


def test_byte_tokenizer_rejects_lone_surrogates_and_out_of_range_ids() -> None:
    """Unencodable text and ids outside 0..255 raise ConfigError naming the problem."""
    tokenizer = ByteTokenizer()
    with pytest.raises(ConfigError, match="surrogate"):
        tokenizer.encode("a\ud800")
    with pytest.raises(ConfigError, match="got 256"):
        tokenizer.decode([1, 256])


# -- request validation ------------------------------------------------------------------------


def test_parse_accepts_tokens_with_session_and_request_ids() -> None:
    """A well-formed token request comes back typed, tokens as int32."""
    request = parse_prefill_request(
        _body(tokens=[1, -(2**31), 2**31 - 1], session_id="s", request_id="r-1")
    )
    assert request.tokens.dtype == np.int32
    assert request.tokens.tolist() == [1, -(2**31), 2**31 - 1]
    assert (request.session_id, request.request_id, request.source) == ("s", "r-1", "tokens")


def test_parse_tokenizes_text_and_leaves_request_id_optional() -> None:
    """A text prompt becomes its UTF-8 bytes; request_id defaults to None."""
    request = parse_prefill_request(_body(text="abc", session_id="s"))
    assert request.tokens.tolist() == [97, 98, 99]
    assert request.request_id is None
    assert request.source == "text"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_non_standard_constant_is_refused_in_one_message(constant: str) -> None:
    """NaN was reported twice over: "body must be valid JSON, got a parse error: body must be
    valid JSON, got the non-standard constant NaN"."""
    body = f'{{"tokens": [{constant}], "session_id": "s"}}'.encode()
    with pytest.raises(InvalidRequestError) as caught:
        parse_prefill_request(body)
    assert str(caught.value) == f"body must be valid JSON, got the non-standard constant {constant}"
    assert (caught.value.field, caught.value.error) == ("body", "malformed_json")


@pytest.mark.parametrize(
    ("body", "field", "error", "message"),
    [
        (b"{not json", "body", "malformed_json", "valid JSON"),
        (b"\xff\xfe", "body", "malformed_json", "must be UTF-8, got byte 0xff at offset 0"),
        (  # a UTF-16 body (json.loads alone would guess the encoding from its first bytes)
            '{"tokens": [1], "session_id": "s"}'.encode("utf-16"),
            "body",
            "malformed_json",
            "must be UTF-8, got byte 0xff at offset 0",
        ),
        (b'{"tokens": [1], "session_id": "s", "": 1}', "", "unknown_field", "'' is not a known"),
        (b'{"tokens": [NaN], "session_id": "s"}', "body", "malformed_json", "NaN"),
        (b"[1, 2]", "body", "invalid_field", "JSON object, got an array"),
        (_body(session_id="s"), "tokens", "missing_field", "tokens is required"),
        (_body(tokens=[1]), "session_id", "missing_field", "session_id is required"),
        (_body(tokens="1 2", session_id="s"), "tokens", "invalid_field", "got a string"),
        (_body(tokens=[], session_id="s"), "tokens", "invalid_field", "must not be empty"),
        (_body(tokens=[1, 2.5], session_id="s"), "tokens", "invalid_field", r"tokens\[1\]"),
        (_body(tokens=[True], session_id="s"), "tokens", "invalid_field", "got a boolean"),
        (_body(tokens=[2**31], session_id="s"), "tokens", "invalid_field", "int32"),
        (_body(tokens=[-(2**31) - 1], session_id="s"), "tokens", "invalid_field", "int32"),
        (_body(tokens=[1], text="a", session_id="s"), "tokens", "invalid_field", "exclusive"),
        (_body(text="", session_id="s"), "text", "invalid_field", "must not be empty"),
        (_body(text=["a"], session_id="s"), "text", "invalid_field", "got an array"),
        (_body(tokens=[1], session_id=7), "session_id", "invalid_field", "got an integer"),
        (_body(tokens=[1], session_id=""), "session_id", "invalid_field", "must not be empty"),
        (_body(tokens=[1], session_id="s", request_id=None), "request_id", "invalid_field", "null"),
        (_body(tokens=[1], session_id="s" * 257), "session_id", "invalid_field", "at most 256"),
        (_body(tokens=[1], session_id="s", token=[2]), "token", "unknown_field", "not a known"),
        (_body(tokens=[1], session_id="s", cache_salt=3), "cache_salt", "invalid_field", "string"),
        (_body(tokens=[1], session_id="s", cache_salt=""), "cache_salt", "invalid_field", "empty"),
        (  # JSON can spell a lone surrogate; it cannot be hashed into a key or logged
            b'{"tokens": [1], "session_id": "s", "cache_salt": "\\udfff"}',
            "cache_salt",
            "invalid_field",
            "cache_salt must be valid UTF-8 text, got a lone surrogate",
        ),
        (  # json.loads keeps the last one silently: which prompt did the client mean?
            b'{"tokens": [1], "session_id": "s", "tokens": [2]}',
            "tokens",
            "invalid_field",
            "tokens appears twice in the body",
        ),
        (
            b'{"tokens": [1], "session_id": "s", "session_id": "t"}',
            "session_id",
            "invalid_field",
            "session_id appears twice in the body",
        ),
        (  # a terminal escape would reach the console log raw
            b'{"tokens": [1], "session_id": "s\\u001b[31mX"}',
            "session_id",
            "invalid_field",
            r"session_id must not hold control characters, got '\\x1b' at index 1",
        ),
        (  # DEL and the C1 controls (U+0085, U+009B: a one-character CSI) too
            b'{"tokens": [1], "session_id": "s", "request_id": "r\\u007f"}',
            "request_id",
            "invalid_field",
            "request_id must not hold control characters",
        ),
        (
            b'{"tokens": [1], "session_id": "s", "cache_salt": "t\\u009b31m"}',
            "cache_salt",
            "invalid_field",
            r"cache_salt must not hold control characters, got '\\x9b' at index 1",
        ),
        (
            b'{"tokens": [1], "session_id": "a\\ud800b"}',
            "session_id",
            "invalid_field",
            "at index 1",
        ),
        (
            b'{"tokens": [1, ' + b"9" * 5000 + b'], "session_id": "s"}',
            "tokens",
            "invalid_field",
            r"tokens\[1\] must be within int32 .*got an integer of 5000 digits",
        ),
        (
            b'{"tokens": [1], "session_id": -' + b"1" * 30 + b"}",
            "session_id",
            "invalid_field",
            "got an integer of 30 digits",
        ),
        (
            b'{"tokens": [1, -' + b"9" * 25 + b'], "session_id": "s"}',
            "tokens",
            "invalid_field",
            r"tokens\[1\] must be within int32 .*got an integer of 25 digits",
        ),
        (
            b'{"tokens": [1, 2147483648], "session_id": "s"}',
            "tokens",
            "invalid_field",
            r"tokens\[1\] must be within int32 .*got 2147483648$",
        ),
        (
            b'{"tokens": [1, true], "session_id": "s"}',
            "tokens",
            "invalid_field",
            r"tokens\[1\] must be an integer, got a boolean",
        ),
    ],
)
def test_parse_rejects_bad_bodies_naming_the_field(
    body: bytes, field: str, error: str, message: str
) -> None:
    """Every malformed body raises InvalidRequestError with the culprit field and a 400."""
    with pytest.raises(InvalidRequestError, match=message) as caught:
        parse_prefill_request(body)
    assert caught.value.field == field
    assert caught.value.error == error
    assert caught.value.status == 400
    assert caught.value.to_json() == {"error": error, "field": field, "message": str(caught.value)}


def test_parse_takes_an_optional_cache_salt() -> None:
    """cache_salt is passed through when given and None otherwise."""
    assert parse_prefill_request(_body(tokens=[1], session_id="s")).cache_salt is None
    salted = parse_prefill_request(_body(tokens=[1], session_id="s", cache_salt="tenant-a"))
    assert salted.cache_salt == "tenant-a"


def test_parse_enforces_max_tokens_for_tokens_and_text() -> None:
    """Prompts longer than the pipeline's context are refused, counting text in bytes."""
    assert parse_prefill_request(_body(tokens=[1] * 4, session_id="s"), max_tokens=4)
    with pytest.raises(
        InvalidRequestError, match=r"^tokens must hold at most 4 tokens, got 5$"
    ) as caught:
        parse_prefill_request(_body(tokens=[1] * 5, session_id="s"), max_tokens=4)
    assert caught.value.field == "tokens"
    with pytest.raises(
        InvalidRequestError, match=r"^text must encode to at most 4 tokens, got 6$"
    ) as caught:
        parse_prefill_request(_body(text="ééé", session_id="s"), max_tokens=4)
    assert caught.value.field == "text"


class _DropsSpaces:
    """A tokenizer with no token for whitespace (as a model's may have)."""

    tokenizer_id = "drops-spaces"

    def encode(self, text: str) -> npt.NDArray[np.int32]:
        return np.array([ord(c) for c in text if not c.isspace()], dtype=np.int32)


def test_parse_refuses_text_that_encodes_to_no_token() -> None:
    """A text the tokenizer turns into no token is the client's error (400, naming the text),
    not a prefill that fails later on an empty prompt."""
    body = _body(text="   ", session_id="s")
    with pytest.raises(
        InvalidRequestError, match=r"^text must encode to at least one token, got none for '   '$"
    ) as caught:
        parse_prefill_request(body, tokenizer=_DropsSpaces())
    assert (caught.value.field, caught.value.error) == ("text", "invalid_field")
    assert parse_prefill_request(_body(text=" a ", session_id="s"), tokenizer=_DropsSpaces())
    with pytest.raises(InvalidRequestError, match=r"got none for '      .*characters\)$") as caught:
        parse_prefill_request(_body(text=" " * 100_000, session_id="s"), tokenizer=_DropsSpaces())
    assert len(str(caught.value)) < 200  # the text quoted cut short, not whole


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(), min_size=1, max_size=20))
def test_parse_accepts_exactly_the_int32_token_lists(tokens: list[int]) -> None:
    """A token list is accepted iff every id fits int32, and then round-trips unchanged."""
    body = _body(tokens=tokens, session_id="s")
    if all(-(2**31) <= token < 2**31 for token in tokens):
        assert parse_prefill_request(body).tokens.tolist() == tokens
    else:
        with pytest.raises(InvalidRequestError, match="int32"):
            parse_prefill_request(body)


# -- Prometheus exposition ---------------------------------------------------------------------

SPECIAL = (float("inf"), float("-inf"), float("nan"), 2.0, 1e-7)

FAMILIES = [
    MetricFamily(
        name="demo_hits_total",
        help="Hits.\nPer stage \\ cache.",
        type="counter",
        samples=[Sample(value=3, labels=(("stage_id", 'a"b\\c\nd'),))],
    ),
    MetricFamily(
        name="demo_seconds",
        help="Durations.",
        type="summary",
        samples=[Sample(value=0.25, suffix="_sum"), Sample(value=2, suffix="_count")],
    ),
    MetricFamily(name="demo_empty", help="No samples yet.", type="gauge"),
    MetricFamily(
        name="demo_special",
        help="Special values.",
        type="gauge",
        samples=[Sample(value=v, labels=(("v", str(i)),)) for i, v in enumerate(SPECIAL)],
    ),
]


def _round_trip(text: str) -> dict[str, tuple[str, str, list[tuple[str, dict[str, str], float]]]]:
    return {
        family.name: (
            family.type,
            family.documentation,
            [(sample.name, sample.labels, sample.value) for sample in family.samples],
        )
        for family in text_string_to_metric_families(text)
    }


def test_the_text_exposition_keeps_names_help_labels_and_values() -> None:
    """Counters keep their _total sample names, summaries their _sum/_count; help texts and
    label values with backslashes, quotes and newlines survive; an empty family is declared."""
    body, content_type = MetricsExporter().render(FAMILIES)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    text = body.decode()
    assert "# TYPE demo_hits_total counter\n" in text
    assert "# HELP demo_empty No samples yet.\n# TYPE demo_empty gauge\n" in text
    parsed = _round_trip(text)
    assert parsed["demo_hits"] == (
        "counter",
        "Hits.\nPer stage \\ cache.",
        [("demo_hits_total", {"stage_id": 'a"b\\c\nd'}, 3.0)],
    )
    assert parsed["demo_seconds"][2] == [
        ("demo_seconds_sum", {}, 0.25),
        ("demo_seconds_count", {}, 2.0),
    ]
    assert parsed["demo_empty"] == ("gauge", "No samples yet.", [])
    values = [value for _, _, value in parsed["demo_special"][2]]
    assert values[:2] == [float("inf"), float("-inf")]
    assert math.isnan(values[2])
    assert values[3:] == [2.0, 1e-7]


def test_openmetrics_is_served_when_the_scraper_asks_for_it() -> None:
    body, content_type = MetricsExporter().render(
        FAMILIES, "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"
    )
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    text = body.decode()
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in openmetrics_families(text)}  # type: ignore[no-untyped-call]
    assert [s.name for s in families["demo_hits"].samples] == ["demo_hits_total"]


def test_an_exporter_writes_only_the_families_it_is_given() -> None:
    """Each app has its own registry: nothing from the process-wide default registry (Python's
    GC and process metrics) and nothing left over from an earlier scrape."""
    exporter = MetricsExporter()
    assert exporter.render(FAMILIES)[0].decode().count("# TYPE") == len(FAMILIES)
    assert exporter.render([])[0] == b""


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_inflight", 0),
        ("max_inflight", True),
        ("max_body_bytes", 1.5),
        ("retry_after_s", 0),
        ("shutdown_timeout_s", 0.0),
        ("shutdown_timeout_s", float("nan")),
        ("body_timeout_s", -1),
        ("body_timeout_s", "30"),
    ],
)
def test_server_settings_reject_non_positive_or_mistyped_limits(field: str, value: object) -> None:
    """Each limit must be positive (and an integer where HTTP needs one); the error names it."""
    with pytest.raises(ConfigError, match=f"^{field} must be"):
        ServerSettings(**{field: value})  # type: ignore[arg-type]


def test_importing_the_serve_command_does_not_import_hypercorn() -> None:
    """The CLI can import the serve command without the server extra's packages."""
    code = (
        "import sys, stage_runtime.server.command; "
        "print('hypercorn' in sys.modules, 'starlette' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.split() == ["False", "False"]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["tokens", "text", "session_id", "request_id", "cache_salt", "x"]),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)


_HUGE_INTEGERS = st.integers(min_value=1, max_value=6000).map(lambda n: "7" * n)
"""Integer literals up to beyond Python's 4300-digit conversion limit."""


def _with_huge_integer(doc: object, literal: str) -> bytes:
    """``doc`` as JSON with its first integer replaced by ``literal`` (or appended as a token)."""
    text = json.dumps(doc)
    spliced = re.sub(r"(?<![\w.\-\"])\d+(?![\w.\"])", literal, text, count=1)
    if spliced == text:
        spliced = json.dumps({"tokens": [0], "session_id": "s"}).replace("0", literal, 1)
    return spliced.encode()


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        _JSON.map(lambda doc: json.dumps(doc).encode()),
        st.builds(_with_huge_integer, _JSON, _HUGE_INTEGERS),
        st.binary(max_size=40),
    )
)
def test_parse_never_fails_with_anything_but_invalid_request(body: bytes) -> None:
    """Any body either parses or raises InvalidRequestError with a 400 and a named field."""
    error: InvalidRequestError | None = None
    try:
        request = parse_prefill_request(body)
    except InvalidRequestError as exc:
        error = exc
    if error is not None:
        assert error.status == 400
        assert error.field
        assert str(error)
    else:
        assert request.tokens.size > 0
        assert request.session_id


class _Stream(io.StringIO):
    """A stderr stand-in that says whether it is a terminal."""

    def __init__(self, *, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        """What the test asked for."""
        return self._tty


@pytest.mark.parametrize("tty", [False, True], ids=["pipe", "terminal"])
def test_request_logs_are_json_lines_unless_stderr_is_a_terminal(
    tty: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serve command's logging (format auto) writes JSON to a pipe and text to a terminal."""
    stream = _Stream(tty=tty)
    monkeypatch.setattr(sys, "stderr", stream)
    saved = structlog.get_config()
    try:
        configure_logging(level="info", log_format="auto")
        structlog.get_logger("test").info(
            "request_served", status=200, tokens=3, restored_tokens={"stage-0": 0}, elapsed_s=0.1
        )
    finally:
        structlog.reset_defaults()
        structlog.configure(**saved)
    [line] = stream.getvalue().splitlines()
    if tty:
        plain = re.sub(r"\x1b\[[0-9;]*m", "", line)  # the console renderer colours a terminal
        assert plain != line
        assert not plain.startswith("{")
        assert "request_served" in plain
        assert "status=200" in plain
    else:
        event = json.loads(line)
        assert event["event"] == "request_served"
        assert (event["status"], event["tokens"], event["level"]) == (200, 3, "info")
        assert event["restored_tokens"] == {"stage-0": 0}
        assert event["timestamp"].endswith("Z")


def _log_an_error(monkeypatch: pytest.MonkeyPatch, *, tty: bool, log_format: str) -> str:
    """What the serve command's logging writes for an error logged with its traceback, from a
    frame holding a local variable of forty x's."""
    stream = _Stream(tty=tty)
    monkeypatch.setattr(sys, "stderr", stream)
    saved = structlog.get_config()
    try:
        configure_logging(level="info", log_format=log_format)
        secret_local = "x" * 40  # noqa: F841 - a local the traceback must not print
        try:
            raise RuntimeError("handler bug")
        except RuntimeError:
            structlog.get_logger("test").error("request_failed", exc_info=True)
    finally:
        structlog.reset_defaults()
        structlog.configure(**saved)
    return stream.getvalue()


def test_console_tracebacks_leave_out_local_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal an error's traceback is shown without each frame's locals: rendering the
    locals of a server's trio frames took seconds, with the event loop stalled meanwhile."""
    written = _log_an_error(monkeypatch, tty=True, log_format="console")
    text = re.sub(r"\x1b\[[0-9;]*m", "", written)
    assert "RuntimeError: handler bug" in text
    assert "xxxxxxxxxx" not in text


def test_json_tracebacks_leave_out_local_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """In JSON lines (a server under a supervisor) an error's traceback is structured but
    without each frame's locals: with them, one failed request's line was 0.4 to 1.4 MB and
    held the request's fields."""
    written = _log_an_error(monkeypatch, tty=False, log_format="json")
    [line] = written.splitlines()
    event = json.loads(line)
    [error] = event["exception"]
    assert (error["exc_type"], error["exc_value"]) == ("RuntimeError", "handler bug")
    assert error["frames"]
    assert all("locals" not in frame or not frame["locals"] for frame in error["frames"])
    assert "xxxxxxxxxx" not in line
