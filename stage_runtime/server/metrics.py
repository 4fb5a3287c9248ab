"""``GET /metrics`` through ``prometheus_client``.

The app describes its metrics at scrape time as :class:`MetricFamily` values (name, help, type,
samples) built from the pipeline's statistics; :class:`MetricsExporter` hands them to a custom
collector registered on a private ``CollectorRegistry`` (never the process-wide default one, so
two apps in one process, or the user's own metrics, do not collide) and lets
``prometheus_client`` write them: the classic text format, or OpenMetrics when the scraper's
``Accept`` header asks for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

import attrs
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["MetricFamily", "MetricType", "MetricsExporter", "Sample"]

MetricType = Literal["counter", "gauge", "summary", "untyped"]


@attrs.frozen(kw_only=True)
class Sample:
    """One sample of a family: optional name suffix (``_sum``, ``_count``), labels and value."""

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

    def metric(self) -> Metric:
        """The ``prometheus_client`` family (a counter's family name drops ``_total``)."""
        name = self.name.removesuffix("_total") if self.type == "counter" else self.name
        metric = Metric(name, self.help, self.type)
        for sample in self.samples:
            metric.add_sample(self.name + sample.suffix, dict(sample.labels), float(sample.value))
        return metric


class _ScrapeCollector(Collector):
    """Yields the families of the scrape in progress (none between scrapes)."""

    def __init__(self) -> None:
        self.families: Sequence[MetricFamily] = ()

    def collect(self) -> Iterator[Metric]:
        return (family.metric() for family in self.families)


@attrs.define(eq=False)
class MetricsExporter:
    """One app's private registry and its collector."""

    _collector: _ScrapeCollector = attrs.field(factory=_ScrapeCollector, init=False)
    _registry: CollectorRegistry = attrs.field(init=False)

    @_registry.default
    def _new_registry(self) -> CollectorRegistry:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._collector)
        return registry

    def render(self, families: Iterable[MetricFamily], accept: str = "") -> tuple[bytes, str]:
        """The exposition of ``families`` and its content type, in the format ``accept`` (an
        HTTP ``Accept`` header) asks for: OpenMetrics if it names it, else the text format."""
        encoder, content_type = choose_encoder(accept)
        self._collector.families = tuple(families)
        try:
            return encoder(self._registry), content_type
        finally:
            self._collector.families = ()
