"""Prometheus text exposition (format 0.0.4), written by hand.

The server exports a few dozen samples; a small, tested renderer is simpler than a dependency and
its global registry. Each family gets its ``# HELP`` and ``# TYPE`` lines followed by its samples;
label values and help texts are escaped as the format requires.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Final, Literal

import attrs

__all__ = ["CONTENT_TYPE", "MetricFamily", "MetricType", "Sample", "render_metrics"]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` of the text exposition format."""

MetricType = Literal["counter", "gauge", "summary", "untyped"]


@attrs.frozen(kw_only=True)
class Sample:
    """One line of a family: optional name suffix (``_sum``, ``_count``), labels and value."""

    value: float
    """The sample's value."""

    labels: tuple[tuple[str, str], ...] = ()
    """Label pairs in output order."""

    suffix: str = ""
    """Appended to the family name, for summaries' ``_sum`` and ``_count``."""


@attrs.frozen(kw_only=True)
class MetricFamily:
    """A metric family: name, help text, type and its samples."""

    name: str
    """Metric name; counters end in ``_total`` by convention."""

    help: str
    """One-line description shown by ``# HELP``."""

    type: MetricType
    """The Prometheus metric type."""

    samples: Sequence[Sample] = ()
    """The family's samples; a family without samples still documents itself."""


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def render_metrics(families: Iterable[MetricFamily]) -> str:
    """Render families in the Prometheus text format (ends with a newline)."""
    lines: list[str] = []
    for family in families:
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for sample in family.samples:
            labels = ""
            if sample.labels:
                pairs = ",".join(f'{key}="{_escape_label(val)}"' for key, val in sample.labels)
                labels = "{" + pairs + "}"
            lines.append(f"{family.name}{sample.suffix}{labels} {_format_value(sample.value)}")
    return "\n".join(lines) + "\n"
