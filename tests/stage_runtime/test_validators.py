"""The shared integer checks: what they accept, what they refuse, and the words they use."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from stage_runtime._validators import (
    check_int,
    check_int_in,
    int_range,
    is_int,
    positive_int,
    u64,
)
from stage_runtime.errors import ConfigError, FrameError
from stage_runtime.limits import U64_MAX


def test_is_int_refuses_bool_and_takes_numpy_integers_only_when_asked() -> None:
    """``True`` is an int to Python, never a count; numpy integers pass where asked for."""
    assert is_int(3)
    assert not is_int(True)
    assert not is_int(3.0)
    assert not is_int(np.int64(3))
    assert is_int(np.int64(3), numpy=True)
    assert not is_int(np.bool_(True), numpy=True)


@pytest.mark.parametrize(
    ("value", "high", "message"),
    [
        (0, None, "n must be an integer >= 1, got 0"),
        (True, None, "n must be an integer >= 1, got True"),
        ("2", None, "n must be an integer >= 1, got '2'"),
        (256, 255, "n must be an integer in [1, 255], got 256"),
        (2**64, U64_MAX, "n must be an integer in [1, 18,446,744,073,709,551,615], got"),
    ],
)
def test_check_int_names_the_rule_and_the_value(value: object, high: int, message: str) -> None:
    """One message for a wrong type and a value out of range: the field, the rule, the value."""
    with pytest.raises(ConfigError) as caught:
        check_int("n", value, low=1, high=high)
    assert str(caught.value).startswith(message)


def test_check_int_in_names_the_bound_crossed_and_raises_the_error_asked_for() -> None:
    """The configs' words: which rule failed; a frame check raises FrameError."""
    assert check_int_in("n", np.int32(7), low=0, high=9, numpy=True) == 7
    with pytest.raises(FrameError, match=r"^n must be an integer, got 1\.5$"):
        check_int_in("n", 1.5, low=0, high=9, error=FrameError)
    with pytest.raises(ConfigError, match=r"^n must be >= 0, got -1$"):
        check_int_in("n", -1, low=0, high=9)
    with pytest.raises(ConfigError, match=r"^n must be <= 9, got 10$"):
        check_int_in("n", 10, low=0, high=9)


@attrs.frozen(kw_only=True)
class _Limits:
    count: int = attrs.field(default=0, validator=u64)
    workers: int = attrs.field(default=1, validator=positive_int)
    width: int = attrs.field(default=1, alias="columns", validator=int_range(1, 8))


def test_attrs_validators_name_the_field_or_the_keyword_the_caller_used() -> None:
    """Validators of attrs fields name the field (its alias when it has one)."""
    assert _Limits(count=U64_MAX).count == U64_MAX
    with pytest.raises(ConfigError, match=f"^count must be <= {U64_MAX}, got {U64_MAX + 1}$"):
        _Limits(count=U64_MAX + 1)
    with pytest.raises(ConfigError, match=r"^workers must be an integer >= 1, got False$"):
        _Limits(workers=False)
    with pytest.raises(ConfigError, match=r"^columns must be an integer in \[1, 8\], got 9$"):
        _Limits(columns=9)
