"""One /metrics for all replicas: each replica's Prometheus text, every sample labelled replica="ID",
merged family by family (the text format wants a family's samples together, under one HELP and TYPE)."""

from __future__ import annotations

from typing import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

REPLICA_LABEL = "replica"


def merge_metrics(texts: Mapping[str, str]) -> bytes:
    """`texts`: replica id -> that replica's /metrics text; returns one exposition with a replica label."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples += [sample._replace(labels={REPLICA_LABEL: replica, **sample.labels})
                               for sample in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
