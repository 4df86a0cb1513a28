"""IndexedTier: what the local tiers (gpu, cpu, disk) share on top of BaseTier."""

from __future__ import annotations

import abc
from collections import Counter, OrderedDict
from typing import Any, Generic, TypeVar

from tierkv.storage_backends.invariants import invariant
from tierkv.storage_backends.leases import Lease, Leases
from tierkv.storage_backends.names import DEFAULT_NAMESPACE, check_key, check_namespace
from tierkv.storage_backends.segment import KVSegment, SegmentError
from tierkv.storage_backends.stats import TierStats
from tierkv.storage_backends.tier import BaseTier

E = TypeVar("E")


class IndexedTier(BaseTier, Generic[E]):
    """What the local tiers (gpu, cpu, disk) share: an LRU `index` of entries keyed by
    (ns, key) (oldest first), per-namespace `counts`, `used_bytes` against `capacity_bytes`,
    leases, LRU eviction of unleased entries, and check_integrity. A subclass calls
    `_start_index(...)` in its constructor and implements `_entry_bytes(entry)` (the capacity
    an entry takes), `_release(entry)` (free what it holds once it has left the index),
    `_evicted(entry)` (the entry as a segment for on_evict), and may add `_check_entries()`."""

    index: OrderedDict[tuple[str, bytes], E]
    counts: dict[str, int]
    leases: Leases
    used_bytes: int
    reserved_bytes: int  # bytes being written, not indexed yet (they count against capacity)
    capacity_bytes: int
    lease_ttl_s: float

    def _start_index(self, capacity_bytes: int, lease_ttl_s: float, **stats: Any) -> None:
        self.index = OrderedDict()
        self.counts = {}
        self.leases = Leases()
        self.used_bytes = self.reserved_bytes = 0
        self.capacity_bytes, self.lease_ttl_s = capacity_bytes, lease_ttl_s
        self._start_stats(capacity_bytes=capacity_bytes, **stats)

    @abc.abstractmethod
    def _entry_bytes(self, entry: E) -> int: ...

    @abc.abstractmethod
    def _release(self, entry: E) -> None: ...

    @abc.abstractmethod
    def _evicted(self, entry: E) -> KVSegment | None: ...

    def _check_entries(self) -> None:
        pass

    def _in_use(self, entry: E) -> bool:
        """True while a reader holds the entry's memory itself (never evicted then)."""
        return False

    # -- the index -------------------------------------------------------------------------
    def _add(self, ns: str, key: bytes, entry: E) -> None:
        self.index[(ns, key)] = entry
        self.counts[ns] = self.counts.get(ns, 0) + 1
        self.used_bytes += self._entry_bytes(entry)

    def _remove(self, ns: str, key: bytes) -> bool:
        entry = self.index.pop((ns, key), None)
        if entry is None:
            return False
        self.used_bytes -= self._entry_bytes(entry)
        self.counts[ns] -= 1
        if not self.counts[ns]:
            del self.counts[ns]
        self._release(entry)
        return True

    def _touch(self, ns: str, key: bytes) -> bool:
        if (ns, key) not in self.index:
            return False
        self.index.move_to_end((ns, key))
        return True

    def _corrupt(self, ns: str, key: bytes) -> None:
        """A corrupt or unreadable entry: counted as an error and removed (the caller misses)."""
        self._stats.errors += 1
        if self._remove(ns, key):
            self._changed("removed", ns, key, why="corrupt")

    async def _contains(self, ns: str, keys: list[bytes]) -> list[bool]:
        return [(ns, k) in self.index for k in keys]

    async def _delete(self, ns: str, key: bytes) -> bool:
        return self._remove(ns, key)

    def _make_room(self, n: int) -> bool:
        """Evict unleased entries, least recently used first, until n more bytes fit; False,
        with nothing evicted, when they cannot."""
        if n > self.capacity_bytes:
            return False
        free = self.capacity_bytes - self.used_bytes - self.reserved_bytes
        if free >= n:
            return True
        victims = []
        for ident, entry in self.index.items():
            if free >= n:
                break
            if not self.leases.held(*ident) and not self._in_use(entry):
                victims.append(ident)
                free += self._entry_bytes(entry)
        if free < n:
            return False  # nothing is evicted unless it makes enough room
        for ns, key in victims:
            self._evict(ns, key)
        if self.check_invariants:
            self.check_integrity()
        return True

    def _evict(self, ns: str, key: bytes) -> None:
        seg = None
        if self.on_evict is not None:
            try:
                seg = self._evicted(self.index[(ns, key)])
            except SegmentError:
                self._stats.errors += 1
        self._remove(ns, key)
        self._stats.evictions += 1
        self._changed("removed", ns, key, why="evicted")
        if seg is not None and self.on_evict is not None:
            self.on_evict(ns, key, seg)

    # -- the rest of the interface ---------------------------------------------------------
    def lease(self, key: bytes, ns: str = DEFAULT_NAMESPACE, ttl: float | None = None) -> Lease:
        ttl = self.lease_ttl_s if ttl is None else ttl
        return self.leases.take(check_namespace(ns), check_key(key), ttl)

    def _fill_stats(self, s: TierStats) -> None:
        s.used_bytes, s.num_segments = self.used_bytes, len(self.index)

    def count(self, ns: str = DEFAULT_NAMESPACE) -> int:
        return self.counts.get(ns, 0)

    def check_integrity(self) -> None:
        """The index, byte accounting and namespace counts agree, and use is within capacity;
        InvariantError when not."""
        used = sum(self._entry_bytes(e) for e in self.index.values())
        invariant(self.used_bytes == used, f"used bytes drifted: {self.used_bytes} != {used}")
        invariant(
            self.used_bytes + self.reserved_bytes <= self.capacity_bytes,
            f"above capacity: {self.used_bytes} + {self.reserved_bytes} > {self.capacity_bytes}",
        )
        counts = Counter(ns for ns, _ in self.index)
        invariant(dict(counts) == self.counts, "namespace counts drifted")
        self._check_entries()
