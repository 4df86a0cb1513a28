"""The tiered store: ordered tiers (fastest first) behind the one Tier interface."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from tierkv.storage_backends.buffers import clone_to, copy_into
from tierkv.storage_backends.hints import KVHint
from tierkv.storage_backends.leases import LeaseGroup
from tierkv.storage_backends.names import DEFAULT_NAMESPACE, check_key, check_namespace, check_put
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.stats import TierStats, summed
from tierkv.storage_backends.stream import LayerSink
from tierkv.storage_backends.stream_merge import merged_stream
from tierkv.storage_backends.tier import ChangeHook, SegmentLayer, Tier
from tierkv.storage_backends.workflow import Prefetcher, hint_tiers, share_book
from tierkv.storage_backends.write_queue import Job, WriteQueue


@dataclass(slots=True)
class StoreConfig:
    # background writes waiting for the slower tiers; beyond it they are dropped
    queue_size: int = 64
    workers: int = 1  # tasks draining that queue
    promote: bool = True  # a hit in a slower tier is copied into every faster tier

    def __post_init__(self) -> None:
        if self.queue_size < 1 or self.workers < 1:
            raise ValueError(
                f"queue_size and workers must be >= 1, got {self.queue_size}, {self.workers}"
            )


@dataclass(slots=True)
class StoreStats:
    hits: int = 0  # gets answered by some tier (or by a segment moving between two)
    misses: int = 0  # gets no tier could answer
    queued: int = 0  # background writes accepted
    dropped: int = 0  # background writes refused because the queue was full
    written: int = 0  # background puts that stored a segment in a slower tier
    promoted: int = 0  # hits further down copied (queued, or at once with `out`) to faster tiers
    demoted: int = 0  # evicted segments handed to the next tier
    lost: int = 0  # background writes whose source was gone (evicted) before they ran
    tiers: list[TierStats] = field(default_factory=list)


class TieredStore(Tier):
    """put lands in tiers[0] at once and reaches the others through a bounded queue (a full
    queue drops and counts; put never waits for it); get reads the fastest tier holding the
    key and promotes it; an eviction from tiers[i] is queued for tiers[i + 1] (demotion).
    Every fault of a tier is that tier's miss, so the store falls through to the next."""

    name = "store"

    def __init__(self, tiers: Sequence[Tier], config: StoreConfig | None = None) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = list(tiers)
        self.config = config or StoreConfig()
        self._stats = StoreStats()
        self._writes = WriteQueue(
            self.tiers, self.config.queue_size, self.config.workers, self._stats
        )
        for i, t in enumerate(self.tiers[:-1]):
            t.on_evict = self._writes.demoter(i)
        self.prefetcher = Prefetcher(self)
        share_book(self.tiers)

    # -- workflow hints (storage_backends.hints, eviction, prefetch) ------------------------
    def hint(
        self, keys: Sequence[bytes], ns: str, hint: KVHint | None, pin_ttl_s: float = 0.0
    ) -> tuple[int, int]:
        """Advise the tiers' HintBook of hint's workflow, tag keys with its agent (held, or
        pending until they land: bounded per namespace, expiring) and soft-pin them
        (pin_ttl_s > 0) where held; (keys tagged, keys pinned). Only ns's entries change
        rank."""
        return hint_tiers(self.tiers, keys, ns, hint, pin_ttl_s)

    def prefetch(self, keys: Sequence[bytes], ns: str = DEFAULT_NAMESPACE) -> int:
        """Move keys up to tiers[0] in the background (storage_backends.workflow); returns at
        once with how many it looks for. A get meanwhile reads normally, never waiting."""
        return self.prefetcher.start(keys, ns)

    # -- the Tier interface ----------------------------------------------------------------
    async def put(self, key: bytes, segment: KVSegment, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_put(key, segment, ns)
        ok = await self.tiers[0].put(key, segment, ns)
        if len(self.tiers) > 1:
            # The queued job must not see later writes to the caller's tensor: it keeps a
            # segment handed over (`owned`) as it is, else reads it back from tiers[0], or,
            # when tiers[0] refused it, keeps a private copy.
            src: KVSegment | None = segment
            if not segment.owned:
                payload = segment.payload
                src = None if ok else KVSegment(segment.header, clone_to(payload, payload.device))
            ok = self._writes.put(Job(ns, key, src, 0, list(range(1, len(self.tiers))))) or ok
        return ok

    def landed(self, key: bytes, ns: str) -> None:
        """A segment committed straight into tiers[0] (storage_backends.page_landing): queued
        for the slower tiers as a put's is, read back from tiers[0] when its turn comes."""
        if len(self.tiers) > 1:
            self._writes.put(Job(ns, key, None, 0, list(range(1, len(self.tiers)))))

    async def get(self, key: bytes, ns: str = DEFAULT_NAMESPACE, out=None) -> KVSegment | None:
        return (await self.get_from(key, ns, out))[0]

    async def get_from(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE, out=None
    ) -> tuple[KVSegment | None, str]:
        """get, and the name of the tier that answered ("" on a miss)."""
        check_namespace(ns)
        check_key(key)
        for i, tier in enumerate(self.tiers):
            seg = await tier.get(key, ns, out)
            if seg is not None:
                if self.config.promote and i:
                    await self._promote(key, seg, ns, i, out)
                self._stats.hits += 1
                return seg, tier.name
        moving = self._writes.moving.get((ns, key))  # between two tiers right now: still a hit
        if moving is not None:
            seg = moving[0] if out is None else copy_into(moving[0], out)
            if self.config.promote and await self.tiers[0].put(key, seg, ns):
                self._stats.promoted += 1
            self._stats.hits += 1
            return seg, self.tiers[moving[1]].name
        self._stats.misses += 1
        return None, ""

    async def _promote(self, key: bytes, seg: KVSegment, ns: str, i: int, out) -> None:
        """Copy a hit in tiers[i] into the faster tiers: queued, so that the load does not wait
        for it (the job keeps seg, which views a buffer of its own), or at once when seg views
        the caller's `out`, which the caller may overwrite as soon as get returns."""
        if out is None and self._writes.put(Job(ns, key, seg, i, list(range(i)))):
            self._stats.promoted += 1
            return
        stored = [await faster.put(key, seg, ns) for faster in self.tiers[:i]]
        self._stats.promoted += any(stored)

    async def get_layers(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE
    ) -> AsyncIterator[SegmentLayer]:
        check_namespace(ns)
        check_key(key)
        for tier in self.tiers:
            if not (await tier.contains([key], ns))[0]:
                continue
            got = 0
            async for chunk in tier.get_layers(key, ns):
                got += 1
                yield chunk
            if got:
                return  # complete, or a fault midway: either way the reader knows by the count

    async def stream(self, keys: Sequence[bytes], ns: str, sink: LayerSink) -> None:
        await self.stream_from(keys, ns, sink)

    async def stream_from(self, keys: Sequence[bytes], ns: str, sink: LayerSink) -> list[str]:
        """stream, each key from the fastest tier holding it, every tier's share at once, merged
        layer by layer; the name of the tier asked for each key ("": none). Hits in a slower
        tier are copied once they are whole and queued for promotion."""
        where = await self.locate(keys, ns, guess_last=True)
        promote = self._promote if self.config.promote else None
        hits = await merged_stream(self.tiers, where, keys, ns, sink, promote)
        self._stats.hits += hits
        self._stats.misses += len(keys) - hits
        return ["" if w is None else self.tiers[w].name for w in where]

    async def contains(self, keys: Sequence[bytes], ns: str = DEFAULT_NAMESPACE) -> list[bool]:
        return [loc is not None for loc in await self.locate(keys, ns)]

    async def locate(
        self, keys: Sequence[bytes], ns: str = DEFAULT_NAMESPACE, guess_last: bool = False
    ) -> list[int | None]:
        """Index of the fastest tier holding each key, None where no tier has it. guess_last:
        the last tier is not asked; keys no faster tier holds are placed there (a stream asks
        it for them anyway, and a remote tier's `contains` is a round trip)."""
        check_namespace(ns)
        for k in keys:
            check_key(k)
        where: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for i, tier in enumerate(self.tiers[:-1] if guess_last else self.tiers):
            if not todo:
                break
            found = await tier.contains([keys[j] for j in todo], ns)
            for j, f in zip(todo, found):
                if f:
                    where[j] = i
            todo = [j for j, f in zip(todo, found) if not f]
        for j in todo:  # between two tiers right now: where it is going (get serves it meanwhile)
            moving = self._writes.moving.get((ns, keys[j]))
            if moving is not None:
                where[j] = moving[1]
            elif guess_last:
                where[j] = len(self.tiers) - 1
        return where

    async def delete(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_namespace(ns)
        # background writes of it not yet done must not bring it back
        moving = self._writes.cancel(ns, check_key(key))
        self.prefetcher.cancel(ns, key)
        return any([await t.delete(key, ns) for t in self.tiers]) or moving

    def lease(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE, ttl: float | None = None
    ) -> LeaseGroup:
        return LeaseGroup(
            [t.lease(key, ns) if ttl is None else t.lease(key, ns, ttl) for t in self.tiers]
        )

    def watch(self, hook: ChangeHook | None) -> None:
        """Every tier's entries coming and going (TierChange, named by the tier) go to hook; a
        demotion shows as removed from one tier and stored in the next."""
        for t in self.tiers:
            t.on_change = hook

    def check_integrity(self) -> None:
        """Each tier's check_integrity (InvariantError when one fails)."""
        for t in self.tiers:
            t.check_integrity()

    def stats(self) -> TierStats:
        """Store hits and misses, and the sums over tiers; store_stats() has each tier and the
        queue."""
        total = summed(self.name, [t.stats() for t in self.tiers])
        total.hits, total.misses = self._stats.hits, self._stats.misses
        return total

    def store_stats(self) -> StoreStats:
        return dataclasses.replace(self._stats, tiers=[t.stats() for t in self.tiers])

    def count(self, ns: str = DEFAULT_NAMESPACE) -> int:
        """Entries of ns in the tier that holds most of them (tiers overlap, so no sum)."""
        return max(t.count(ns) for t in self.tiers)

    async def drain(self) -> None:
        """Wait until every queued background write and prefetch has run (tests, shutdown)."""
        await self.prefetcher.drain()
        await self._writes.drain()

    async def close(self) -> None:
        await self.prefetcher.drain()
        await self._writes.close()
        for t in self.tiers:
            await t.close()
