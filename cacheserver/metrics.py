"""Prometheus metrics, all prefixed `tierkv_`, served over HTTP on --metrics-port.

Per-tier counters come from each tier's own TierStats (snapshotted by the server loop,
so a scrape never touches the store); RPCs are counted and timed by the server.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# TierStats fields that only grow; every other numeric field is exported as a gauge.
_COUNTERS = (
    "hits",
    "misses",
    "evictions",
    "errors",
    "puts",
    "gets",
    "bytes_read",
    "bytes_written",
    "dropped",
    "demotions",
    "promotions",
    "deletes",
)
_LATENCY = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


def stats_dict(stats: Any) -> dict[str, Any]:
    """A TierStats (dataclass, slots or not) as a plain dict."""
    if is_dataclass(stats) and not isinstance(stats, type):
        return asdict(stats)
    return dict(stats)


@dataclass(slots=True, eq=False)  # hashable by identity: the registry keys on it
class _TierCollector:
    snapshot: dict[str, dict[str, Any]] = field(default_factory=dict)  # tier -> stats

    def collect(self) -> Iterator[Metric]:
        names = sorted(
            {
                k
                for s in self.snapshot.values()
                for k, v in s.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
        )
        for name in names:
            is_counter = name in _COUNTERS
            family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(
                f"tierkv_tier_{name}", f"tier {name} (from TierStats)", labels=["tier"]
            )
            for tier, s in self.snapshot.items():
                v = s.get(name)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    family.add_metric([tier], float(v))
            yield family


@dataclass(slots=True, eq=False)
class _HintCollector:
    """The hint book's totals over every namespace (a namespace's own are in its Stats)."""

    counts: dict[str, int] = field(default_factory=dict)  # tagged, pinned, pending -> items
    events: dict[str, int] = field(default_factory=dict)  # BookStats: dropped, expired, applied

    def collect(self) -> Iterator[Metric]:
        for name, v in sorted(self.counts.items()):
            g = GaugeMetricFamily(f"tierkv_hint_{name}", f"hint book: {name} keys, all namespaces")
            g.add_metric([], float(v))
            yield g
        for name, v in sorted(self.events.items()):
            c = CounterMetricFamily(f"tierkv_hint_{name}", f"hint book: keys {name}")
            c.add_metric([], float(v))
            yield c


@dataclass(slots=True)
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    tiers: _TierCollector = field(default_factory=_TierCollector)
    hints: _HintCollector = field(default_factory=_HintCollector)
    rpc_seconds: Histogram = field(init=False)
    rpc_total: Counter = field(init=False)
    wire_bytes: Counter = field(init=False)
    rejected: Counter = field(init=False)
    watch_dropped: Counter = field(init=False)
    watchers: Gauge = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.rpc_seconds = Histogram(
            "tierkv_rpc_seconds", "RPC latency", ["method"], buckets=_LATENCY, registry=r
        )
        self.rpc_total = Counter(
            "tierkv_rpc", "RPCs by final status", ["method", "code"], registry=r
        )
        self.wire_bytes = Counter(
            "tierkv_wire_bytes", "segment bytes over gRPC", ["direction"], registry=r
        )
        self.rejected = Counter(
            "tierkv_rejected", "requests refused by limits or validation", ["reason"], registry=r
        )
        self.watch_dropped = Counter(
            "tierkv_watch_dropped", "Watch events lost to a watcher's full queue", registry=r
        )
        self.watchers = Gauge("tierkv_watchers", "open Watch streams", registry=r)
        r.register(self.tiers)
        r.register(self.hints)

    def update_tiers(self, stats: dict[str, Any]) -> None:
        self.tiers.snapshot = {name: stats_dict(s) for name, s in stats.items()}

    def update_hints(self, counts: dict[str, int], events: dict[str, int]) -> None:
        self.hints.counts, self.hints.events = dict(counts), dict(events)

    def serve(self, port: int, host: str) -> None:
        """Start the HTTP exporter in a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)
