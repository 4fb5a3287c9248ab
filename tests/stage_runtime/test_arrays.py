"""The numpy helpers of the cache's hot paths."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime._arrays import first_difference


@settings(max_examples=300, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=40),
    dtype=st.sampled_from([np.int32, np.uint8]),
)
def test_first_difference_is_the_first_index_where_two_arrays_differ(
    pairs: list[tuple[int, int]], dtype: type[np.generic]
) -> None:
    """The first index whose elements differ, or the length for equal arrays (empty too)."""
    left = np.array([a for a, _ in pairs], dtype=dtype)
    right = np.array([b for _, b in pairs], dtype=dtype)
    expected = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    assert first_difference(left, right) == expected
    assert first_difference(left, left) == len(pairs)
