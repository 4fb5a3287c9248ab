"""Data files shipped with stage-runtime (see ``ATTRIBUTION.md`` next to this file)."""

from __future__ import annotations

from importlib import resources
from importlib.abc import Traversable

__all__ = ["DEMO_TRACE", "demo_trace"]

DEMO_TRACE = "mooncake_synthetic_excerpt.jsonl"
"""File name of the bundled trace excerpt (300 requests of the Mooncake synthetic trace)."""


def demo_trace() -> Traversable:
    """The bundled trace excerpt, as an :mod:`importlib.resources` traversable."""
    return resources.files(__name__).joinpath(DEMO_TRACE)
