"""tierkv's counters in vLLM's own /metrics (`vllm serve`): vLLM builds this in its front end
through TierKVConnector.build_prom_metrics and feeds it the summed TierKVStats of every step.

Names carry vLLM's `vllm:` prefix and its labels (model_name, engine); `vllm:tierkv_hit_tokens`
has a `tier` label too. Its sum over tiers equals vLLM's `vllm:external_prefix_cache_hits`: both
count, at admission, the tokens vLLM took from the connector."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

# stats key -> (metric name, documentation); each a counter
COUNTERS = {
    "lookups": ("tierkv_lookups", "Lookups of prompt chunks in the shared tier."),
    "lookup_hit_tokens": ("tierkv_lookup_hit_tokens", "Tokens lookups found (before admission)."),
    "loaded_tokens": ("tierkv_loaded_tokens", "Tokens loaded into vLLM's KV cache."),
    "loaded_bytes": ("tierkv_load_bytes", "Bytes of KV loaded."),
    "load_misses": ("tierkv_load_misses", "Chunks gone between lookup and load."),
    "load_rejected": ("tierkv_load_rejected", "Chunks refused by verification (header, checksum)."),
    "load_timeouts": ("tierkv_load_timeouts", "Loads given up after load_timeout_s."),
    "load_errors": ("tierkv_load_errors", "Loads that failed in a tier or the scatter."),
    "recomputed_tokens": ("tierkv_recomputed_tokens", "Tokens whose load failed, recomputed."),
    "saved_chunks": ("tierkv_saved_chunks", "Chunks stored."),
    "saved_bytes": ("tierkv_save_bytes", "Bytes of KV stored."),
    "save_skipped": ("tierkv_save_skipped", "Chunks not saved: the store held them."),
    "save_dropped": ("tierkv_save_dropped", "Chunks not saved: too many pending, or put failed."),
    "events_dropped": ("tierkv_events_dropped", "KV events lost to a full queue."),
    "pd_handoffs": ("tierkv_pd_handoffs", "Prefills for a remote decode answered with a claim."),
    "pd_refused": ("tierkv_pd_refused", "Remote-prefill claims refused (malformed, foreign)."),
    "pd_timeouts": ("tierkv_pd_timeouts", "Remote-prefill claims not all present by the deadline."),
}
TIERS = ("gpu", "cpu", "disk", "server", "redis")
BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class TierKVProm(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per = self.per_engine_labelvalues
        self.counters = {
            k: create_metric_per_engine(
                self._counter_cls(name=f"vllm:{n}", documentation=d, labelnames=labelnames), per
            )
            for k, (n, d) in COUNTERS.items()
        }
        hits = self._counter_cls(
            name="vllm:tierkv_hit_tokens",
            documentation="Prompt tokens vLLM took from tierkv, by the tier that held them "
            "(sums to vllm:external_prefix_cache_hits).",
            labelnames=[*labelnames, "tier"],
        )
        self.hits = {
            e: {t: hits.labels(*values, t) for t in TIERS} for e, values in per.items()
        }  # every tier shown from the start, at 0
        self.seconds = {
            k: create_metric_per_engine(
                self._histogram_cls(
                    name=f"vllm:tierkv_{k}",
                    documentation=f"tierkv {k.split('_')[0]} latency (one request's chunks).",
                    buckets=BUCKETS,
                    labelnames=labelnames,
                ),
                per,
            )
            for k in ("load_seconds", "save_seconds")
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            if k in self.counters:
                if v > 0:
                    self.counters[k][engine_idx].inc(v)
            elif k.startswith("hit_tokens."):
                tier = k.split(".", 1)[1]
                if v > 0 and tier in self.hits[engine_idx]:
                    self.hits[engine_idx][tier].inc(v)
            elif k in self.seconds:
                for s in v:
                    self.seconds[k][engine_idx].observe(s)
