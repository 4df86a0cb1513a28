"""Prometheus export of the connector's counters and its tiers' stats (`tierkv_connector_*`,
`tierkv_tier_*`), read at scrape time; served on ConnectorConfig.metrics_port."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tierkv.cacheserver.metrics import _TierCollector, stats_dict


@dataclass(slots=True, eq=False)
class ConnectorCollector:
    connector: Any  # anything with stats and store: a TierKVConnector, a WorkerCore

    def collect(self) -> Iterator[Metric]:
        stats = self.connector.stats
        for name, value in asdict(stats).items():
            fam: Metric
            if isinstance(value, list):  # latency windows: export the median
                fam = GaugeMetricFamily(
                    f"tierkv_connector_{name.replace('seconds', 'p50_seconds')}",
                    f"median of recent {name}",
                )
                fam.add_metric([], statistics.median(value) if value else 0.0)
            else:
                fam = CounterMetricFamily(f"tierkv_connector_{name}", f"connector {name}")
                fam.add_metric([], float(value))
            yield fam
        tiers = _TierCollector({t.name: stats_dict(t.stats()) for t in self.connector.store.tiers})
        yield from tiers.collect()


def serve_metrics(connector: Any, port: int, host: str = "127.0.0.1") -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ConnectorCollector(connector))
    start_http_server(port, addr=host, registry=registry)
    return registry
