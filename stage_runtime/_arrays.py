"""Small numpy helpers shared by the cache's hot paths."""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

__all__ = ["first_difference"]


def first_difference(left: npt.NDArray[Any], right: npt.NDArray[Any]) -> int:
    """The index of the first element where two 1-D arrays of one length differ, or their
    length when they are equal.

    ``argmax`` of the comparison stops at its first ``True``; ``flatnonzero`` would list every
    difference (most of a long prompt, after the two part) before the first could be read.
    """
    differ = left != right
    if not differ.size:
        return 0
    index = int(differ.argmax())
    return index if differ[index] else int(differ.size)
