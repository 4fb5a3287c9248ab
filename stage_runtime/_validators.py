"""Integer checks shared by the configs, messages and call boundaries of the package.

Two shapes of the same rule: attrs validators (``validator=u64``) for fields of attrs classes,
and plain check functions (:func:`check_int`) for arguments where no attrs class is involved.
Both refuse ``bool`` (an ``int`` to Python, never a count to a user) and name the field and the
bad value in a :class:`~stage_runtime.errors.ConfigError` (or the error class asked for).

The limits themselves live in :mod:`stage_runtime.limits`.
"""

from __future__ import annotations

from typing import Any, Final, Literal, TypeGuard, overload

import numpy as np

from stage_runtime.errors import ConfigError, shown
from stage_runtime.limits import I32_MAX, I32_MIN, U32_MAX, U64_MAX

__all__ = [
    "AttrsValidator",
    "at_least",
    "check_int",
    "check_int_in",
    "check_non_negative_int",
    "check_positive_int",
    "i32",
    "int_in",
    "int_range",
    "is_int",
    "non_negative_int",
    "optional_int_in",
    "positive_int",
    "positive_u32",
    "positive_u64",
    "u32",
    "u64",
]

AttrsValidator = Any
"""An attrs validator ``(instance, attribute, value) -> None``: typed ``Any`` because mypy
--strict cannot mix typed callables with attrs' own validators in one field."""


@overload
def is_int(value: object, *, numpy: Literal[False] = False) -> TypeGuard[int]: ...


@overload
def is_int(value: object, *, numpy: bool) -> TypeGuard[int | np.integer[Any]]: ...


def is_int(value: object, *, numpy: bool = False) -> TypeGuard[int | np.integer[Any]]:
    """Whether ``value`` is an integer: an ``int`` that is not a ``bool`` (and, with ``numpy``,
    a numpy integer scalar)."""
    if type(value) is int:  # the usual case, decided at once
        return True
    kinds = (int, np.integer) if numpy else int
    return isinstance(value, kinds) and not isinstance(value, bool)


def _rule(low: int, high: int | None) -> str:
    if high is None:
        return f"an integer >= {low}"
    return f"an integer in [{low:,}, {high:,}]"


def check_int(
    name: str,
    value: object,
    *,
    low: int,
    high: int | None = None,
    numpy: bool = False,
    error: type[ValueError] = ConfigError,
) -> int:
    """``value`` as an ``int`` when it is an integer (see :func:`is_int`) within
    ``[low, high]`` (no upper bound when ``high`` is None).

    Raises:
        ConfigError: (or ``error``) ``"{name} must be an integer >= {low}, got {value}"``, or
            ``"... an integer in [low, high] ..."`` when there is an upper bound.
    """
    if is_int(value, numpy=numpy):
        number = int(value)
        if number >= low and (high is None or number <= high):
            return number
    msg = f"{name} must be {_rule(low, high)}, got {shown(value)}"
    raise error(msg)


def check_non_negative_int(name: str, value: object, *, numpy: bool = False) -> int:
    """``value`` as an ``int`` when it is an integer >= 0; else a ConfigError naming ``name``."""
    return check_int(name, value, low=0, numpy=numpy)


def check_positive_int(name: str, value: object, *, numpy: bool = False) -> int:
    """``value`` as an ``int`` when it is an integer >= 1; else a ConfigError naming ``name``."""
    return check_int(name, value, low=1, numpy=numpy)


def check_int_in(
    name: str,
    value: object,
    *,
    low: int,
    high: int,
    numpy: bool = False,
    error: type[ValueError] = ConfigError,
) -> int:
    """``value`` as an ``int`` when it is an integer (see :func:`is_int`) within
    ``[low, high]``; the message says which rule failed.

    Raises:
        ConfigError: (or ``error``) ``"{name} must be an integer, got 'x'"``,
            ``"{name} must be >= {low}, got 0"`` or ``"{name} must be <= {high}, got 256"``.
    """
    if type(value) is int and low <= value <= high:  # the usual case, decided at once
        return value
    if not is_int(value, numpy=numpy):
        msg = f"{name} must be an integer, got {shown(value)}"
        raise error(msg)
    number = int(value)
    if number < low:
        msg = f"{name} must be >= {low}, got {shown(value)}"
        raise error(msg)
    if number > high:
        msg = f"{name} must be <= {high}, got {shown(value)}"
        raise error(msg)
    return number


def int_in(
    low: int, high: int, *, numpy: bool = False, error: type[ValueError] = ConfigError
) -> AttrsValidator:
    """An attrs validator: an integer (not ``bool``) within ``[low, high]``, in the words of
    :func:`check_int_in` (``"max_entries must be >= 1, got 0"``)."""

    def check(_instance: object, attribute: Any, value: object) -> None:
        if type(value) is int and low <= value <= high:  # the usual case, decided at once
            return
        check_int_in(attribute.name, value, low=low, high=high, numpy=numpy, error=error)

    return check


def optional_int_in(low: int, high: int) -> AttrsValidator:
    """:func:`int_in`, also accepting None."""
    inner = int_in(low, high)

    def check(instance: object, attribute: Any, value: object) -> None:
        if value is not None:
            inner(instance, attribute, value)

    return check


def int_range(
    low: int,
    high: int | None = None,
    *,
    numpy: bool = False,
    error: type[ValueError] = ConfigError,
) -> AttrsValidator:
    """An attrs validator: an integer (not ``bool``) within ``[low, high]`` (no upper bound when
    ``high`` is None), in the words of :func:`check_int`, naming the keyword the caller used
    (the attribute's alias)."""

    def check(_instance: object, attribute: Any, value: object) -> None:
        if type(value) is int and value >= low and (high is None or value <= high):
            return
        name = attribute.alias or attribute.name
        check_int(name, value, low=low, high=high, numpy=numpy, error=error)

    return check


def at_least(low: int) -> AttrsValidator:
    """:func:`int_range` without an upper bound."""
    return int_range(low)


u64: Final[AttrsValidator] = int_in(0, U64_MAX)
"""An attrs validator: an unsigned 64-bit integer (the upstream's counts and bounds)."""

positive_u64: Final[AttrsValidator] = int_in(1, U64_MAX)
"""An attrs validator: a u64 that is at least 1."""

u32: Final[AttrsValidator] = int_in(0, U32_MAX)
"""An attrs validator: an unsigned 32-bit integer (layers, indices, versions)."""

positive_u32: Final[AttrsValidator] = int_in(1, U32_MAX)
"""An attrs validator: a u32 that is at least 1."""

i32: Final[AttrsValidator] = int_in(I32_MIN, I32_MAX)
"""An attrs validator: a signed 32-bit integer."""

non_negative_int: Final[AttrsValidator] = at_least(0)
"""An attrs validator: an integer >= 0, no upper bound."""

positive_int: Final[AttrsValidator] = at_least(1)
"""An attrs validator: an integer >= 1, no upper bound."""
