"""Constructors without validators for the frozen attrs classes the hot path builds.

A frozen attrs class checks every field in its ``__init__`` (about 0.8 us for six fields). The
caches build some of them many times per request from values that are valid by construction
(an eviction's key, counts and sizes come from the cache's own entries), so they use
:func:`unchecked_constructor` instead: the same object, each slot set directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

__all__ = ["unchecked_constructor"]

_T = TypeVar("_T")


def unchecked_constructor(cls: type[_T]) -> Callable[..., _T]:
    """A function that builds a ``cls`` from every field, positionally and in field order,
    with no validators, converters or defaults (``cls`` must be a frozen, slotted attrs class;
    tests check each one built this way against its own ``__init__``).

    Raises:
        attrs.exceptions.NotAnAttrsClassError: ``cls`` is not an attrs class.
        TypeError: ``cls`` is an attrs class without slots.
    """
    names = [field.name for field in attrs.fields(cls)]  # type: ignore[arg-type]
    if "__slots__" not in vars(cls):
        msg = f"{cls.__name__} is not a slotted attrs class"
        raise TypeError(msg)
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    lines = [f"def make({', '.join(names)}):", "    self = _new(_cls)"]
    for position, name in enumerate(names):
        namespace[f"_set{position}"] = getattr(cls, name).__set__
        lines.append(f"    _set{position}(self, {name})")
    lines.append("    return self")
    exec("\n".join(lines), namespace)  # (source generated from the class's own field names)
    make: Callable[..., _T] = namespace["make"]
    make.__qualname__ = f"unchecked_constructor({cls.__name__})"
    return make
