"""What each namespace did on the server, and the Stats answer to one namespace's caller."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.store import TieredStore
from tierkv.storage_backends.workflow import book_of


@dataclass(slots=True)
class NsCounters:
    """What one namespace did; Stats reports only the caller's."""

    lookups: int = 0
    puts: int = 0
    gets: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    hits: dict[str, int] = field(default_factory=dict)  # tier -> gets it served
    misses: int = 0


async def stats_response(store: TieredStore, ns: str, c: NsCounters) -> pb.StatsResponse:
    """ns's Stats: each tier's count and usage, ns's own hits and misses per tier, and ns's
    entries in the hint book (never another namespace's)."""
    tiers = []
    names = [t.name for t in store.tiers]
    for i, t in enumerate(store.tiers):
        s = t.stats()
        count = await t.scan_count(ns) if hasattr(t, "scan_count") else t.count(ns)
        # A tier missed every get that a slower tier served or that no tier could.
        missed = c.misses + sum(c.hits.get(n, 0) for n in names[i + 1 :])
        tiers.append(
            pb.TierStats(
                name=t.name,
                count=count,
                used_bytes=s.used_bytes,
                capacity_bytes=s.capacity_bytes,
                hits=c.hits.get(t.name, 0),
                misses=missed,
                evictions=s.evictions,
                errors=s.errors,
            )
        )
    book = book_of(store.tiers)
    hints = pb.HintStats(**book.counts(ns)) if book is not None else pb.HintStats()
    return pb.StatsResponse(
        namespace=ns,
        hints=hints,
        tiers=tiers,
        lookups=c.lookups,
        puts=c.puts,
        gets=c.gets,
        bytes_in=c.bytes_in,
        bytes_out=c.bytes_out,
    )
