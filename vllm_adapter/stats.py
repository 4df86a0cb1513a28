"""tierkv's connector counters as vLLM connector stats: the worker sends what changed since its
last report, vLLM's scheduler adds the reports up and logs them ("KV Transfer metrics")."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tierkv.connector.plan import ConnectorStats


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
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass(slots=True)
class Reporter:
    """What changed in stats since the last report."""

    last: dict[str, int] = field(default_factory=dict)

    def delta(self, stats: ConnectorStats) -> TierKVStats | None:
        now = counters(stats)
        diff = {k: v - self.last.get(k, 0) for k, v in now.items() if v != self.last.get(k, 0)}
        self.last = now
        return TierKVStats(diff) if diff else None
