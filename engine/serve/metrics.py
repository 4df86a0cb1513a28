"""Prometheus metrics of the server (`tierkv_serve_*`): latency histograms, request and token
counters, and queue/cache gauges the engine thread snapshots after each step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from tierkv.engine.sequence import Sequence

# Seconds: TTFT spans a cached hit (ms) to a long cold prefill under load (tens of s).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServeMetrics:
    def __init__(self, connector: Any = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "tierkv_serve_ttft_seconds", "arrival to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "tierkv_serve_tpot_seconds",
            "time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.requests = Counter("tierkv_serve_requests", "requests admitted", registry=r)
        self.aborted = Counter("tierkv_serve_aborted", "requests whose client left", registry=r)
        self.rejected = Counter("tierkv_serve_rejected", "requests refused (429)", registry=r)
        self.prompt_tokens = Counter("tierkv_serve_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "tierkv_serve_generation_tokens", "output tokens", registry=r
        )
        self.prefix_hit_tokens = Counter(
            "tierkv_serve_prefix_cache_hit_tokens",
            "prompt tokens from the prefix cache",
            registry=r,
        )
        self.connector_hit_tokens = Counter(
            "tierkv_serve_connector_hit_tokens", "prompt tokens loaded by the connector", registry=r
        )
        self.pd_prefills = Counter("tierkv_serve_pd_prefills", "prefills handed over", registry=r)
        self.pd_not_durable = Counter(
            "tierkv_serve_pd_not_durable",
            "prefills whose KV was not all on the shared tier by the flush deadline",
            registry=r,
        )
        self.pd_decodes = Counter("tierkv_serve_pd_decodes", "decodes of a handoff", registry=r)
        self.pd_refused = Counter(
            "tierkv_serve_pd_refused",
            "handoffs naming another model's, namespace's or engine's KV (recomputed)",
            registry=r,
        )
        self.state: dict[str, float] = {}  # swapped whole by the engine thread
        r.register(_StateCollector(self))
        if connector is not None and hasattr(connector, "stats"):
            from tierkv.connector.metrics import ConnectorCollector

            r.register(ConnectorCollector(connector))

    def observe_finished(self, s: Sequence) -> None:
        m = s.metrics
        if m.first_token_time:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if s.num_output_tokens > 1 and m.finish_time > m.first_token_time:
                self.tpot.observe((m.finish_time - m.first_token_time) / (s.num_output_tokens - 1))
        self.generation_tokens.inc(s.num_output_tokens)
        if s.sample_index == 0:  # the prompt is shared by the request's samples
            self.prompt_tokens.inc(s.num_prompt_tokens)
            self.prefix_hit_tokens.inc(m.num_cached_tokens)
            self.connector_hit_tokens.inc(m.num_external_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        state = self.metrics.state
        for name, doc in (
            ("waiting", "requests queued in the scheduler"),
            ("running", "sequences running"),
            ("kv_usage", "share of KV blocks held by requests (not counting evictable cache)"),
        ):
            fam = GaugeMetricFamily(f"tierkv_serve_{name}", doc)
            fam.add_metric([], state.get(name, 0.0))
            yield fam
