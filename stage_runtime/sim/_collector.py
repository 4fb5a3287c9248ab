"""Fewer full garbage collections while a replay runs.

A replay's stage caches hold hundreds of thousands of entries (a paged replay of the synthetic
trace: some 170,000 page objects) that live for the whole run. CPython's collector traverses
every one of them at each full collection, and as the caches grow it runs one each time the
old generation grows by a quarter: 0.6 s of a 5.5 s paged replay. While a replay runs, the
middle and old generations are collected ten times less often (young cyclic garbage is still
collected as usual); the previous thresholds come back when the last replay running in the
process ends.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

__all__ = ["fewer_full_collections"]

_OLDER_THRESHOLD = 100
"""The collector's generation 1 and 2 thresholds during a replay (CPython's default: 10)."""

_lock = threading.Lock()
_running = 0
_saved: tuple[int, int, int] | None = None


def _forked() -> None:
    """In a child forked while a replay ran in the parent (a thread of it): no replay runs
    here, so the child starts with the thresholds the parent had before, and a fresh lock."""
    global _lock, _running, _saved
    _lock = threading.Lock()
    if _saved is not None:
        gc.set_threshold(*_saved)
    _running = 0
    _saved = None


if hasattr(os, "register_at_fork"):  # (not on Windows)
    os.register_at_fork(after_in_child=_forked)


@contextlib.contextmanager
def fewer_full_collections() -> Iterator[None]:
    """Raise the collector's older thresholds to at least 100 for the block (nested and
    concurrent blocks, in threads too, restore the original thresholds once, at the end of
    the last one)."""
    global _running, _saved
    with _lock:
        if _running == 0:
            _saved = gc.get_threshold()
            young, middle, old = _saved
            gc.set_threshold(young, max(middle, _OLDER_THRESHOLD), max(old, _OLDER_THRESHOLD))
        _running += 1
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            if _running == 0 and _saved is not None:
                gc.set_threshold(*_saved)
                _saved = None
