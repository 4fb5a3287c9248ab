"""Validation of ``POST /v1/prefill`` bodies into typed requests.

Everything a client can get wrong is caught here, before the pipeline sees the request, and
reported as an :class:`InvalidRequestError` that names the offending field. The HTTP layer turns
it into a ``400`` (or ``413``) JSON error; the server itself is never disturbed by bad input.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, NoReturn

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime.config import _DuplicateKeyError, _unique_keys, check_id
from stage_runtime.errors import ConfigError, json_error_detail, shown
from stage_runtime.limits import I32_MAX, I32_MIN
from stage_runtime.pipeline import vocabulary_violation
from stage_runtime.server.tokenizer import ByteTokenizer, TextTokenizer

__all__ = ["InvalidRequestError", "PrefillBody", "parse_prefill_request"]

INT32_MIN: Final = I32_MIN
INT32_MAX: Final = I32_MAX
MAX_ID_CHARS: Final = 256
"""Longest accepted ``session_id`` / ``request_id``: they end up in every log line."""

MAX_INTEGER_DIGITS: Final = 20
"""Longest integer literal parsed as a number; longer ones are refused without converting them
(an int32 token has at most 10 digits, and Python refuses to convert more than 4300)."""

_FIELDS: Final = frozenset({"tokens", "text", "session_id", "request_id", "cache_salt"})


class InvalidRequestError(ConfigError):
    """A request body is unusable; ``field`` names what is wrong and ``status`` the HTTP code."""

    def __init__(self, message: str, *, field: str, error: str, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.error = error
        self.status = status

    def to_json(self) -> dict[str, Any]:
        """The JSON error body sent to the client."""
        return {"error": self.error, "field": self.field, "message": str(self)}


@attrs.frozen(kw_only=True, eq=False)
class PrefillBody:
    """A validated ``POST /v1/prefill`` body (the pipeline's own message is
    :class:`stage_runtime.stage.PrefillRequest`)."""

    tokens: npt.NDArray[np.int32]
    """The prompt's token ids (non-empty, int32)."""

    session_id: str
    """The client's session; the pipeline keys its logs by it."""

    request_id: str | None
    """The client's id for this request, or ``None`` to let the pipeline pick one."""

    source: str
    """``"tokens"`` or ``"text"``: which field the prompt came from."""

    cache_salt: str | None = None
    """The tenant's cache salt, or ``None`` to share cached prefixes with every request."""


@attrs.frozen
class _OversizedInteger:
    """An integer literal too long to be any valid value; kept unconverted."""

    digits: int


def _parse_int(text: str) -> int | _OversizedInteger:
    digits = len(text.lstrip("-"))
    if digits > MAX_INTEGER_DIGITS:
        return _OversizedInteger(digits)
    return int(text)


def _digits(value: int) -> int:
    """Decimal digits of ``value`` (its sign not counted)."""
    return len(str(abs(value)))


def _reject_constant(name: str) -> float:
    msg = f"body must be valid JSON, got the non-standard constant {name}"
    raise InvalidRequestError(msg, field="body", error="malformed_json")


def _missing(field: str, rule: str) -> NoReturn:
    msg = f"{field} is required: {rule}"
    raise InvalidRequestError(msg, field=field, error="missing_field")


def _invalid(field: str, message: str) -> NoReturn:
    raise InvalidRequestError(message, field=field, error="invalid_field")


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, _OversizedInteger):
        return f"an integer of {value.digits} digits"
    if type(value) is int and _digits(value) > MAX_INTEGER_DIGITS:
        return f"an integer of {_digits(value)} digits"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _loads(body: bytes) -> object:
    """The body's JSON: integers parsed natively (one C pass) unless one is too long for
    Python to convert, then again with each integer checked (:func:`_parse_int`), so that the
    error names the token."""
    # JSON on the wire is UTF-8 (RFC 8259); json.loads would also guess UTF-16 or UTF-32 from
    # the first bytes, and then report the garbage it decoded as a parse error.
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        msg = f"body must be UTF-8, got byte {body[exc.start]:#04x} at offset {exc.start}"
        raise InvalidRequestError(msg, field="body", error="malformed_json") from None
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError | InvalidRequestError | _DuplicateKeyError):
            raise
    return json.loads(
        text,
        parse_constant=_reject_constant,
        parse_int=_parse_int,
        object_pairs_hook=_unique_keys,
    )


def _parse_tokens(value: object, *, max_tokens: int | None) -> npt.NDArray[np.int32]:
    # The usual case, checked in bulk: every element a plain int within int32. Anything else
    # goes through the loop below, which names the first bad token.
    if (
        isinstance(value, list)
        and value
        and len(value) <= (max_tokens or len(value))
        and set(map(type, value)) == {int}
    ):
        array = np.asarray(value)
        if (
            array.dtype == np.int64
            and int(array.min()) >= INT32_MIN
            and int(array.max()) <= INT32_MAX
        ):
            return array.astype(np.int32)
    if not isinstance(value, list):
        _invalid("tokens", f"tokens must be an array of integers, got {_type_name(value)}")
    if not value:
        _invalid("tokens", "tokens must not be empty, got []")
    for index, token in enumerate(value):
        if isinstance(token, _OversizedInteger):
            msg = (
                f"tokens[{index}] must be within int32 ({INT32_MIN}..{INT32_MAX}), "
                f"got {_type_name(token)}"
            )
            _invalid("tokens", msg)
        # bool is an int subclass; true/false in a token list is a client bug, not token 1/0.
        if type(token) is not int:
            msg = f"tokens[{index}] must be an integer, got {_type_name(token)}"
            _invalid("tokens", msg)
        if not INT32_MIN <= token <= INT32_MAX:
            quoted = _type_name(token) if _digits(token) > MAX_INTEGER_DIGITS else token
            msg = f"tokens[{index}] must be within int32 ({INT32_MIN}..{INT32_MAX}), got {quoted}"
            _invalid("tokens", msg)
    _check_length("tokens", len(value), max_tokens)
    return np.asarray(value, dtype=np.int32)


def _check_length(field: str, count: int, max_tokens: int | None) -> None:
    if max_tokens is not None and count > max_tokens:
        must = "must encode to" if field == "text" else "must hold"
        msg = f"{field} {must} at most {max_tokens} tokens, got {count}"
        _invalid(field, msg)


def _parse_id(body: Mapping[str, object], field: str) -> str | None:
    """An optional non-empty string of at most :data:`MAX_ID_CHARS` characters."""
    if field not in body:
        return None
    value = body[field]
    if not isinstance(value, str):
        _invalid(field, f"{field} must be a string, got {_type_name(value)}")
    if not value:
        _invalid(field, f'{field} must not be empty, got ""')
    if len(value) > MAX_ID_CHARS:
        msg = f"{field} must be at most {MAX_ID_CHARS} characters, got {len(value)}"
        _invalid(field, msg)
    try:
        check_id(field, value)
    except ConfigError as exc:
        _invalid(field, str(exc))
    return value


def parse_prefill_request(
    body: bytes,
    *,
    max_tokens: int | None = None,
    tokenizer: TextTokenizer | None = None,
    vocab_size: int | None = None,
) -> PrefillBody:
    """Validate a ``POST /v1/prefill`` body.

    The body is a JSON object with exactly one of ``"tokens"`` (array of int32) or ``"text"``
    (string, tokenized by :class:`ByteTokenizer`), a ``"session_id"`` string, an optional
    ``"request_id"`` string and an optional ``"cache_salt"`` string (the tenant's salt: requests
    with another salt, or none, never restore its cached prefixes). Unknown fields are rejected so
    that a misspelt field is not silently ignored.

    Args:
        body: The raw request body.
        max_tokens: Longest accepted prompt in tokens (the pipeline's context size), or ``None``.
        tokenizer: Tokenizer for ``"text"``; the byte-level one by default.
        vocab_size: The model's vocabulary size, when it has one: ids outside ``0..vocab_size-1``
            are refused (``field`` ``"tokens"``).

    Returns:
        The validated request.

    Raises:
        InvalidRequestError: the body is not a valid request; its ``field`` names the culprit.
    """
    try:
        document = _loads(body)
    except _DuplicateKeyError as exc:
        # json.loads keeps the last one silently; the client may have meant the first.
        if exc.key in _FIELDS:
            msg = f"{exc.key} appears twice in the body"
            raise InvalidRequestError(msg, field=exc.key, error="invalid_field") from None
        msg = f"body must not repeat a key in one object, got {exc.key!r} twice"
        raise InvalidRequestError(msg, field="body", error="invalid_field") from None
    except InvalidRequestError:
        raise  # a non-standard constant, already worded (it is a ValueError too)
    except json.JSONDecodeError as exc:
        msg = (
            f"body must be valid JSON, got a parse error: {json_error_detail(exc, one_line=False)}"
        )
        raise InvalidRequestError(msg, field="body", error="malformed_json") from exc
    except ValueError as exc:
        # UnicodeDecodeError, and any other conversion the parser refuses.
        msg = f"body must be valid JSON, got a parse error: {exc}"
        raise InvalidRequestError(msg, field="body", error="malformed_json") from exc
    except RecursionError as exc:
        msg = "body must be valid JSON, got nesting too deep to parse"
        raise InvalidRequestError(msg, field="body", error="malformed_json") from exc
    if not isinstance(document, dict):
        msg = f"body must be a JSON object, got {_type_name(document)}"
        raise InvalidRequestError(msg, field="body", error="invalid_field")
    unknown = sorted(set(document) - _FIELDS)
    if unknown:
        name = unknown[0] or "''"  # (an empty key, quoted so that the message reads)
        msg = f"{name} is not a known field (expected one of {', '.join(sorted(_FIELDS))})"
        raise InvalidRequestError(msg, field=unknown[0], error="unknown_field")

    if "tokens" in document and "text" in document:
        msg = "tokens and text are mutually exclusive: give exactly one of them"
        _invalid("tokens", msg)
    if "tokens" in document:
        tokens = _parse_tokens(document["tokens"], max_tokens=max_tokens)
        source = "tokens"
    elif "text" in document:
        text = document["text"]
        if not isinstance(text, str):
            _invalid("text", f"text must be a string, got {_type_name(text)}")
        if not text:
            _invalid("text", 'text must not be empty, got ""')
        try:
            tokens = (tokenizer or ByteTokenizer()).encode(text)
        except ConfigError as exc:
            raise InvalidRequestError(str(exc), field="text", error="invalid_field") from exc
        if not tokens.size:  # (whitespace, say, to a tokenizer that drops it)
            _invalid("text", f"text must encode to at least one token, got none for {shown(text)}")
        _check_length("text", int(tokens.size), max_tokens)
        source = "text"
    else:
        _missing("tokens", "give a non-empty array of token ids, or a text")

    out_of_vocabulary = vocabulary_violation(tokens, vocab_size)
    if out_of_vocabulary is not None:
        _invalid(source, out_of_vocabulary)
    session_id = _parse_id(document, "session_id")
    if session_id is None:
        _missing("session_id", "a non-empty string naming the client's session")
    request_id = _parse_id(document, "request_id")
    cache_salt = _parse_id(document, "cache_salt")
    return PrefillBody(
        tokens=tokens,
        session_id=session_id,
        request_id=request_id,
        source=source,
        cache_salt=cache_salt,
    )
