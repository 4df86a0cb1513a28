"""tierkv's connector counters as vLLM connector stats: each side (the worker and the scheduler)
sends what changed since its last report, vLLM adds the reports up, logs them ("KV Transfer
metrics") and hands them to `TierKVProm` (prom.py) for its /metrics.

The data is a flat dict: the connector's integer counters by name, `hit_tokens.<tier>` (tokens
vLLM admitted as external hits, by the tier that held them), `events_dropped`, and the latencies
of the loads and saves that ended (`load_seconds`, `save_seconds`: lists of seconds)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tierkv.connector.plan import ConnectorStats

LATENCIES = ("load_seconds", "save_seconds")


class ObservedStats(ConnectorStats):
    """ConnectorStats that also keeps every latency since the last report (the windows it
    inherits are trimmed, so a reporter could not tell what is new). Not a dataclass field:
    asdict(stats), which the connector's own exporters walk, stays ConnectorStats'."""

    __slots__ = ("fresh",)

    def __init__(self) -> None:
        super().__init__()
        self.fresh: dict[str, list[float]] = {k: [] for k in LATENCIES}

    def record(self, which: list[float], seconds: float) -> None:
        ConnectorStats.record(self, which, seconds)
        name = "load_seconds" if which is self.load_seconds else "save_seconds"
        if len(self.fresh[name]) < 4096:  # reported every step: a bound, not a window
            self.fresh[name].append(seconds)


def counters(stats: ConnectorStats) -> dict[str, int]:
    """The integer counters of stats (latency windows left out)."""
    return {k: v for k, v in asdict(stats).items() if isinstance(v, int)}


@dataclass
class TierKVStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> TierKVStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, [] if isinstance(v, list) else 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            if isinstance(v, list):
                if v:
                    out[f"{k}_p50"] = round(statistics.median(v), 4)
            else:
                out[k] = v
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass(slots=True)
class Reporter:
    """What changed since the last report."""

    last: dict[str, int] = field(default_factory=dict)

    def delta(
        self, stats: ConnectorStats, extra: dict[str, int] | None = None
    ) -> TierKVStats | None:
        now = {**counters(stats), **(extra or {})}
        diff: dict[str, Any] = {
            k: v - self.last.get(k, 0) for k, v in now.items() if v != self.last.get(k, 0)
        }
        self.last = now
        if isinstance(stats, ObservedStats):
            for k, seconds in stats.fresh.items():
                if seconds:
                    diff[k], stats.fresh[k] = seconds, []
        return TierKVStats(diff) if diff else None
