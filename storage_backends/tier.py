"""The tier interface and its safety contract, and BaseTier, which writes it once.

`Tier` is the interface (the tiered store implements it too). `BaseTier` writes its public
operations once (argument checks, `out` checks, hit/miss/put counting, latency timing) around
a few hooks each tier implements; `IndexedTier` (indexed_tier.py) adds what the local tiers
share.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from tierkv.storage_backends.buffers import check_out, copy_into, views
from tierkv.storage_backends.invariants import check_invariants_enabled
from tierkv.storage_backends.leases import Hold, Leases
from tierkv.storage_backends.names import DEFAULT_NAMESPACE, check_key, check_namespace, check_put
from tierkv.storage_backends.segment import KVSegment, SegmentHeader
from tierkv.storage_backends.stats import Latency, TierStats
from tierkv.storage_backends.stream import LayerSink, stream_layers


@dataclass(slots=True)
class SegmentLayer:
    """One layer of a streamed segment: `data` is its encoded bytes (check with decode_layer)."""

    header: SegmentHeader
    layer: int
    data: memoryview


EvictHook = Callable[[str, bytes, KVSegment], None]
"""Called with (ns, key, segment) when a tier evicts an entry; the segment is the caller's."""


@dataclass(slots=True)
class TierChange:
    """An entry came into a tier or left it (observers: KV events, the server's watch)."""

    kind: str  # "stored" | "removed"
    tier: str  # the tier's name
    ns: str
    key: bytes
    header: SegmentHeader | None = None  # stored: the segment's header (tokens, parent)
    reason: str = ""  # removed: "evicted" | "corrupt" | "deleted"


ChangeHook = Callable[[TierChange], None]
"""Called on the tier's event loop, synchronously: it must not block or raise."""


class Tier(abc.ABC):
    """One storage tier. Entries are keyed by (ns, key); ns is a tenant and never crosses.

    Safety contract, for every tier:
    - A fault (I/O error, corrupt entry, slow tier down) is a miss or a False, never an
      exception to the caller; it is counted in stats().errors.
    - get verifies the checksums of bytes that come from outside this process (a file, Redis,
      a server) and marks the segment `verified`; a corrupt entry is a miss, counted, and
      removed. Memory tiers hold only bytes they copied from checked or locally computed
      segments and return them unmarked (a reader checks those once, or trusts them).
    - Memory or disk use never exceeds the configured capacity; a segment larger than the
      capacity is refused (put returns False).
    - put copies: the tier never keeps a reference to the caller's tensor or buffer.
    - A segment returned by get is the caller's: with `out`, its payload views `out`;
      without, it does not alias tier memory that eviction may reuse.
    - Bad arguments (bad namespace, wrong key length, a segment made for another key, `out`
      read-only or too small) raise ValueError.
    - Only with the debug setting TIERKV_CHECK_INVARIANTS=1: an operation that evicts raises
      InvariantError when the tier's bookkeeping is found broken (a bug, never a fault).
    """

    name: str = "tier"
    on_evict: EvictHook | None = None
    on_change: ChangeHook | None = None

    def _changed(
        self, kind: str, ns: str, key: bytes, header: SegmentHeader | None = None, why: str = ""
    ) -> None:
        if self.on_change is not None:
            self.on_change(TierChange(kind, self.name, ns, key, header, why))

    @abc.abstractmethod
    async def contains(self, keys: Sequence[bytes], ns: str = DEFAULT_NAMESPACE) -> list[bool]: ...

    @abc.abstractmethod
    async def get(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE, out: Any = None
    ) -> KVSegment | None:
        """The segment, or None on a miss. `out` (writable buffer or contiguous tensor of at
        least the raw payload size) receives the payload, and the returned segment views it."""

    @abc.abstractmethod
    def get_layers(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> AsyncIterator[SegmentLayer]:
        """Layers in order; empty on a miss. Each layer's data is valid until the iterator
        advances. A stream that ends before header.num_layers layers is a miss (a fault midway)."""

    async def stream(self, keys: Sequence[bytes], ns: str, sink: LayerSink) -> None:
        """Load keys layer-major into sink: layer 0 of every key, then layer 1, ... (safety
        contract in storage_backends.stream). Bad keys or namespace raise ValueError first."""
        check_namespace(ns)
        for k in keys:
            check_key(k)
        await stream_layers(lambda k: self.get_layers(k, ns), keys, sink)

    @abc.abstractmethod
    async def put(self, key: bytes, segment: KVSegment, ns: str = DEFAULT_NAMESPACE) -> bool:
        """Store a copy; True when stored. May evict unleased entries, in the tier's eviction
        order (storage_backends.eviction: least recently used first unless configured)."""

    @abc.abstractmethod
    async def delete(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> bool: ...

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    @abc.abstractmethod
    def count(self, ns: str = DEFAULT_NAMESPACE) -> int:
        """Entries held for namespace ns."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    def lease(self, key: bytes, ns: str = DEFAULT_NAMESPACE, ttl: float | None = None) -> Hold:
        """Hold (ns, key) against eviction: `with tier.lease(k): ...`; ends by itself after ttl.
        Tiers without eviction pressure (remote ones) may return a lease that holds nothing."""
        return Leases().take(ns, key, 30.0 if ttl is None else ttl)

    def check_integrity(self) -> None:
        """Raise InvariantError when the tier's own bookkeeping is inconsistent (tests call it;
        TIERKV_CHECK_INVARIANTS=1 makes local tiers call it after every eviction). A tier
        without local bookkeeping has nothing to check."""
        return None


class BaseTier(Tier):
    """A tier whose public operations are written here once. `get`, `get_layers`, `put`,
    `delete` and `contains` check their arguments (and `out`), count hits, misses, puts and
    bytes, and time gets and puts; a tier implements only the hooks below. A hook gets
    checked arguments and turns every fault into a miss (None, a short stream) or a refused
    put, counting it in `_stats.errors`.

    - `_read(ns, key, out)`: `(segment, bytes read)`, or None. It may land the payload in
      `out` (then the segment views it); otherwise the base copies the payload into `out`.
    - `_read_layers(ns, key)`: the layers in order; it stops early on a miss or a fault.
    - `_write(ns, key, segment)`: bytes stored; 0 when it was stored already (nothing is
      counted); None when refused.
    - `_delete(ns, key)`: whether an entry was there.
    - `_contains(ns, keys)`: presence of each key.

    A subclass calls `_start_stats(...)` in its constructor. `_touch(ns, key)` (True when the
    tier holds the key, which it then marks recently used) lets an indexed tier skip rewriting
    what it holds and keep its LRU order; `_fill_stats` adds the tier's gauges to stats().
    """

    _stats: TierStats
    _get_lat: Latency
    _put_lat: Latency
    check_invariants: bool = False

    def _start_stats(self, **values: Any) -> None:
        self._stats = TierStats(name=self.name, **values)
        self._get_lat, self._put_lat = Latency(), Latency()
        self.check_invariants = check_invariants_enabled()

    # -- the hooks -------------------------------------------------------------------------
    @abc.abstractmethod
    async def _read(self, ns: str, key: bytes, out: Any) -> tuple[KVSegment, int] | None: ...

    @abc.abstractmethod
    def _read_layers(self, ns: str, key: bytes) -> AsyncGenerator[SegmentLayer, None]: ...

    @abc.abstractmethod
    async def _write(self, ns: str, key: bytes, segment: KVSegment) -> int | None: ...

    @abc.abstractmethod
    async def _delete(self, ns: str, key: bytes) -> bool: ...

    @abc.abstractmethod
    async def _contains(self, ns: str, keys: list[bytes]) -> list[bool]: ...

    def _touch(self, ns: str, key: bytes) -> bool:
        return False

    def _fill_stats(self, s: TierStats) -> None:
        pass

    # -- the public operations -------------------------------------------------------------
    async def contains(self, keys: Sequence[bytes], ns: str = DEFAULT_NAMESPACE) -> list[bool]:
        check_namespace(ns)
        return await self._contains(ns, [check_key(k) for k in keys])

    async def get(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE, out: Any = None
    ) -> KVSegment | None:
        check_namespace(ns)
        check_key(key)
        if out is not None:
            check_out(out)
        t0 = time.perf_counter()
        got = await self._read(ns, key, out)
        if got is None:
            self._stats.misses += 1
            return None
        seg, nbytes = got
        if out is not None and not views(seg.payload, out):
            seg = copy_into(seg, out)
        self._touch(ns, key)
        self._stats.hits += 1
        self._stats.bytes_out += nbytes
        self._get_lat.add(time.perf_counter() - t0)
        return seg

    async def get_layers(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE
    ) -> AsyncIterator[SegmentLayer]:
        check_namespace(ns)
        check_key(key)
        got, header = 0, None
        async with aclosing(self._read_layers(ns, key)) as layers:
            async for layer in layers:
                got, header = got + 1, layer.header
                self._stats.bytes_out += layer.data.nbytes
                yield layer
        if header is not None and got == header.num_layers:
            self._stats.hits += 1
        else:
            self._stats.misses += 1

    async def put(self, key: bytes, segment: KVSegment, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_put(key, segment, ns)
        if self._touch(ns, key):  # keys name their content: the same key is the same KV
            return True
        t0 = time.perf_counter()
        n = await self._write(ns, key, segment)
        if n is None:
            return False
        if n:
            self._stats.puts += 1
            self._stats.bytes_in += n
            self._put_lat.add(time.perf_counter() - t0)
            self._changed("stored", ns, key, segment.header)
        return True

    async def delete(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_namespace(ns)
        gone = await self._delete(ns, check_key(key))
        if gone:
            self._changed("removed", ns, key, why="deleted")
        return gone

    def stats(self) -> TierStats:
        s = self._stats
        s.get_latency, s.put_latency = self._get_lat.summary(), self._put_lat.summary()
        self._fill_stats(s)
        return dataclasses.replace(s)
