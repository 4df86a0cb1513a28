"""BaseTier: the tier interface's public operations written once (argument checks, `out`
checks, hit/miss/put counting, latency timing) around a few hooks each tier implements;
`IndexedTier` (indexed_tier.py) adds what the local tiers share."""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from tierkv.storage_backends.buffers import check_out, copy_into, views
from tierkv.storage_backends.invariants import check_invariants_enabled
from tierkv.storage_backends.names import DEFAULT_NAMESPACE, check_key, check_namespace, check_put
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.stats import Latency, TierStats
from tierkv.storage_backends.tier import SegmentLayer, Tier


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
