"""What every tier counts: hits, misses, bytes, evictions, errors, and latency."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class LatencySummary:
    count: int = 0
    mean_s: float = 0.0
    p50_s: float = 0.0
    p99_s: float = 0.0
    max_s: float = 0.0


@dataclass(slots=True)
class Latency:
    """Recent latencies (a bounded window, so memory stays fixed) and a running count."""

    window: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    count: int = 0

    def add(self, seconds: float) -> None:
        self.window.append(seconds)
        self.count += 1

    def summary(self) -> LatencySummary:
        if not self.window:
            return LatencySummary()
        xs = sorted(self.window)
        return LatencySummary(
            self.count,
            sum(xs) / len(xs),
            xs[len(xs) // 2],
            xs[min(len(xs) - 1, int(len(xs) * 0.99))],
            xs[-1],
        )


@dataclass(slots=True)
class TierStats:
    name: str = ""
    hits: int = 0  # gets answered, and layer streams that delivered every layer
    misses: int = 0  # gets not answered (absent or faulty), and layer streams that ended short
    bytes_in: int = 0  # bytes stored by puts
    bytes_out: int = 0  # bytes returned by gets and layer streams
    evictions: int = 0
    errors: int = 0  # faults turned into misses or failed puts (corrupt entries, I/O errors)
    puts: int = 0
    get_latency: LatencySummary = field(default_factory=LatencySummary)
    put_latency: LatencySummary = field(default_factory=LatencySummary)
    used_bytes: int = 0
    capacity_bytes: int = 0
    num_segments: int = 0
    device: str = ""
    notes: str = ""


SUMMED = (
    "bytes_in",
    "bytes_out",
    "evictions",
    "errors",
    "puts",
    "used_bytes",
    "capacity_bytes",
    "num_segments",
)  # the fields a store's stats sum over its tiers; hits and misses are its own


def summed(name: str, per: list[TierStats]) -> TierStats:
    """Stats named name, whose device lists the tiers, with the SUMMED fields of per summed."""
    total = TierStats(name=name, device="+".join(s.name for s in per))
    for f in SUMMED:
        setattr(total, f, sum(getattr(s, f) for s in per))
    return total
