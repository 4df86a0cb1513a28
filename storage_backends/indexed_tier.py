"""IndexedTier: what the local tiers (gpu, cpu, disk) share on top of BaseTier."""

from __future__ import annotations

import abc
from collections import Counter, OrderedDict
from typing import Any, Generic, TypeVar

from tierkv.storage_backends.base_tier import BaseTier
from tierkv.storage_backends.eviction import EvictionPolicy, LruPolicy
from tierkv.storage_backends.hint_book import HintBook
from tierkv.storage_backends.hints import KVHint
from tierkv.storage_backends.invariants import invariant
from tierkv.storage_backends.leases import Lease, Leases
from tierkv.storage_backends.names import DEFAULT_NAMESPACE, check_key, check_namespace
from tierkv.storage_backends.segment import KVSegment, SegmentError
from tierkv.storage_backends.stats import TierStats

E = TypeVar("E")


class IndexedTier(BaseTier, Generic[E]):
    """What the local tiers (gpu, cpu, disk) share: an LRU `index` of entries keyed by
    (ns, key) (oldest first), per-namespace `counts` and `ns_bytes`, `used_bytes` against
    `capacity_bytes`, leases, eviction of unleased entries in the order of a pluggable
    `policy` (storage_backends.eviction; LRU by default) ranked by the workflow `hints` of its
    keys, and check_integrity. A subclass calls
    `_start_index(...)` in its constructor and implements `_entry_bytes(entry)` (the capacity
    an entry takes), `_release(entry)` (free what it holds once it has left the index),
    `_evicted(entry)` (the entry as a segment for on_evict), and may add `_check_entries()`."""

    index: OrderedDict[tuple[str, bytes], E]
    counts: dict[str, int]
    ns_bytes: dict[str, int]  # bytes of each namespace's entries (quota policy)
    hints: HintBook[bytes]  # workflow tags and pins of its keys (hinted policy; a store's
    # indexed tiers share one, so tags follow a key across tiers)
    policy: EvictionPolicy
    leases: Leases
    used_bytes: int
    reserved_bytes: int  # bytes being written, not indexed yet (they count against capacity)
    capacity_bytes: int
    lease_ttl_s: float

    def _start_index(
        self,
        capacity_bytes: int,
        lease_ttl_s: float,
        policy: EvictionPolicy | None = None,
        **stats: Any,
    ) -> None:
        self.index = OrderedDict()
        self.counts, self.ns_bytes = {}, {}
        self.hints = HintBook(held=self._holds)
        self.policy = policy or LruPolicy()
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

    def _holds(self, ns: str, key: bytes) -> bool:
        return (ns, key) in self.index

    def _in_use(self, entry: E) -> bool:
        """True while a reader holds the entry's memory itself (never evicted then)."""
        return False

    # -- the index -------------------------------------------------------------------------
    def _add(self, ns: str, key: bytes, entry: E) -> None:
        self.index[(ns, key)] = entry
        self.counts[ns] = self.counts.get(ns, 0) + 1
        n = self._entry_bytes(entry)
        self.used_bytes += n
        self.ns_bytes[ns] = self.ns_bytes.get(ns, 0) + n
        self.hints.landed(ns, key)  # pending tags apply (a put, promotion or prefetch)

    def _remove(self, ns: str, key: bytes, forget: bool = True) -> bool:
        """Take (ns, key) out of the index; its hint tags go too when forget (a delete), else
        they stay in the book, pending while no tier of the book holds the key (an eviction
        or a bad entry: the key may be in, or on its way to, another tier)."""
        entry = self.index.pop((ns, key), None)
        if entry is None:
            return False
        n = self._entry_bytes(entry)
        self.used_bytes -= n
        self.ns_bytes[ns] -= n
        self.counts[ns] -= 1
        if not self.counts[ns]:
            del self.counts[ns], self.ns_bytes[ns]
        if forget:
            self.hints.forget(ns, key)
        else:
            self.hints.left(ns, key)
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
        if self._remove(ns, key, forget=False):
            self._changed("removed", ns, key, why="corrupt")

    async def _contains(self, ns: str, keys: list[bytes]) -> list[bool]:
        return [(ns, k) in self.index for k in keys]

    async def _delete(self, ns: str, key: bytes) -> bool:
        gone = self._remove(ns, key)
        self.hints.forget(ns, key)  # a delete is final: pending tags too (the key was in Redis)
        return gone

    def _make_room(self, n: int, ns: str = DEFAULT_NAMESPACE) -> bool:
        """Evict unleased entries not in use, in the policy's order, until n more bytes (a put
        into ns) fit; False, with nothing evicted, when they cannot."""
        if n > self.capacity_bytes:
            return False
        free = self.capacity_bytes - self.used_bytes - self.reserved_bytes
        if free >= n:
            return True
        cands = (  # lazy: the LRU order reads only as far as it evicts
            (ident, self._entry_bytes(entry))
            for ident, entry in self.index.items()
            if not self.leases.held(*ident) and not self._in_use(entry)
        )
        victims = []
        for ident, nbytes in self.policy.order(self, cands, ns, n):
            if free >= n:
                break
            victims.append(ident)
            free += nbytes
        if free < n:
            return False  # nothing is evicted unless it makes enough room
        for v_ns, v_key in victims:
            self._evict(v_ns, v_key)
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
        self._remove(ns, key, forget=False)
        self._stats.evictions += 1
        self._changed("removed", ns, key, why="evicted")
        if seg is not None and self.on_evict is not None:
            self.on_evict(ns, key, seg)  # the tags wait in the book (pending) for the next tier

    def hint(
        self, ns: str, keys: list[bytes], hint: KVHint | None, pin_ttl_s: float = 0.0
    ) -> tuple[list[bytes], list[bytes]]:
        """HintBook.hint on the tier's book: (keys tagged, keys pinned); only ns's entries
        change rank. Keys are checked by the caller."""
        return self.hints.hint(ns, keys, hint, pin_ttl_s)

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
        per_ns: Counter[str] = Counter()
        for (ns, _), e in self.index.items():
            per_ns[ns] += self._entry_bytes(e)
        invariant(dict(per_ns) == self.ns_bytes, "namespace bytes drifted")
        # The book's tags of keys no tier of it holds are pending (bounded, expiring); it
        # checks that each tagged key is held or pending, and its per-namespace counts.
        self.hints.check_integrity()
        self._check_entries()
