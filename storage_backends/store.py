"""The tiered store: ordered tiers (fastest first) behind the one Tier interface."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from tierkv.storage_backends.buffers import clone_to, copy_into
from tierkv.storage_backends.leases import Hold
from tierkv.storage_backends.names import DEFAULT_NAMESPACE, check_key, check_namespace, check_put
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.stats import TierStats
from tierkv.storage_backends.stream import Keep, LayerSink, Merge
from tierkv.storage_backends.tier import SegmentLayer, Tier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StoreConfig:
    queue_size: int = (
        64  # background writes waiting for the slower tiers; beyond it they are dropped
    )
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


@dataclass(slots=True)
class Job:
    ns: str
    key: bytes
    segment: KVSegment | None  # None: read it from tiers[source] when the job runs
    source: int
    targets: list[int]
    gen: int = 0  # the key's delete generation when queued; a delete since then cancels the job
    # Ask each target whether it holds the key before sending it: only for demotions, since a
    # put's caller has checked (keys name their content) and a promotion's targets missed.
    check: bool = False


@dataclass(slots=True)
class LeaseGroup:
    """A lease on every tier at once."""

    parts: list[Hold]

    def release(self) -> None:
        for p in self.parts:
            p.release()

    def __enter__(self) -> LeaseGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> LeaseGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


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
        self._queue: asyncio.Queue[Job] | None = None
        self._workers: list[asyncio.Task] = []
        # evicted, queued for the next tier: (segment, index of that tier)
        self._moving: dict[tuple[str, bytes], tuple[KVSegment, int]] = {}
        self._queued: dict[tuple[str, bytes], int] = {}  # jobs queued or running per key
        self._gen: dict[
            tuple[str, bytes], int
        ] = {}  # deletes of a key while it had jobs (bounded by them)
        for i, t in enumerate(self.tiers[:-1]):
            t.on_evict = self._demoter(i)

    def _demoter(self, i: int):
        def demote(ns: str, key: bytes, segment: KVSegment) -> None:
            if self._enqueue(Job(ns, key, segment, i, [i + 1], check=True)):
                self._stats.demoted += 1
                self._moving[(ns, key)] = (segment, i + 1)

        return demote

    def _enqueue(self, job: Job) -> bool:
        if self._queue is None:
            self._queue = asyncio.Queue(self.config.queue_size)
            self._workers = [
                asyncio.get_running_loop().create_task(self._work())
                for _ in range(self.config.workers)
            ]
        ident = (job.ns, job.key)
        job.gen = self._gen.get(ident, 0)
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            self._stats.dropped += 1
            return False
        self._queued[ident] = self._queued.get(ident, 0) + 1
        self._stats.queued += 1
        return True

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            job = await self._queue.get()
            try:
                await self._run(job)
            except Exception:  # a tier bug must not kill the worker; the write is just lost
                log.exception("background write of %s failed", job.key.hex())
            finally:
                ident = (job.ns, job.key)
                if job.segment is not None and self._moving.get(ident, (None,))[0] is job.segment:
                    del self._moving[ident]
                self._queued[ident] -= 1
                if not self._queued[ident]:
                    del self._queued[ident]
                    self._gen.pop(ident, None)
                self._queue.task_done()

    async def _run(self, job: Job) -> None:
        seg = job.segment
        if seg is None:
            seg = await self.tiers[job.source].get(job.key, job.ns)
            if seg is None:
                self._stats.lost += 1
                return
        for i in job.targets:
            tier = self.tiers[i]
            if self._gen.get((job.ns, job.key), 0) != job.gen:
                return  # deleted after it was queued: a delete is final
            if job.check and (await tier.contains([job.key], job.ns))[0]:
                continue
            if await tier.put(job.key, seg, job.ns):
                self._stats.written += 1
                if self._gen.get((job.ns, job.key), 0) != job.gen:  # deleted while this put ran
                    await tier.delete(job.key, job.ns)

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
            ok = self._enqueue(Job(ns, key, src, 0, list(range(1, len(self.tiers))))) or ok
        return ok

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
        moving = self._moving.get((ns, key))  # between two tiers right now: still a hit
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
        if out is None and self._enqueue(Job(ns, key, seg, i, list(range(i)))):
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
        groups: dict[int, list[int]] = {}
        for i, w in enumerate(where):
            if w is None:
                sink.drop(i, "miss")
            else:
                groups.setdefault(w, []).append(i)
        merge = Merge(sink, len(groups))
        hits = 0

        async def run(j: int, t: int, index: list[int]) -> None:
            nonlocal hits
            part = merge.part(j, index)
            keep = Keep(part)
            try:
                await self.tiers[t].stream([keys[i] for i in index], ns, keep)
            finally:
                await part.end()
            hits += len(keep.complete())
            for k, seg in keep.whole() if self.config.promote and t else []:
                await self._promote(keys[index[k]], seg, ns, t, None)

        # Every part runs to its end before an error is raised: none may write into the sink's
        # buffers after this returns.
        done = await asyncio.gather(
            *(run(j, t, idx) for j, (t, idx) in enumerate(groups.items())),
            return_exceptions=True,
        )
        errors = [e for e in done if isinstance(e, BaseException)]
        if errors:
            raise errors[0]
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
            moving = self._moving.get((ns, keys[j]))
            if moving is not None:
                where[j] = moving[1]
            elif guess_last:
                where[j] = len(self.tiers) - 1
        return where

    async def delete(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_namespace(ns)
        ident = (ns, check_key(key))
        if ident in self._queued:  # background writes of it not yet done must not bring it back
            self._gen[ident] = self._gen.get(ident, 0) + 1
        moving = self._moving.pop(ident, None) is not None
        return any([await t.delete(key, ns) for t in self.tiers]) or moving

    def lease(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE, ttl: float | None = None
    ) -> LeaseGroup:
        return LeaseGroup(
            [t.lease(key, ns) if ttl is None else t.lease(key, ns, ttl) for t in self.tiers]
        )

    def check_integrity(self) -> None:
        """Each tier's check_integrity (InvariantError when one fails)."""
        for t in self.tiers:
            t.check_integrity()

    def stats(self) -> TierStats:
        """Store hits and misses, and the sums over tiers; store_stats() has each tier and the
        queue."""
        per = [t.stats() for t in self.tiers]
        total = TierStats(name=self.name, device="+".join(s.name for s in per))
        for f in (
            "bytes_in",
            "bytes_out",
            "evictions",
            "errors",
            "puts",
            "used_bytes",
            "capacity_bytes",
            "num_segments",
        ):
            setattr(total, f, sum(getattr(s, f) for s in per))
        total.hits, total.misses = self._stats.hits, self._stats.misses
        return total

    def store_stats(self) -> StoreStats:
        return dataclasses.replace(self._stats, tiers=[t.stats() for t in self.tiers])

    def count(self, ns: str = DEFAULT_NAMESPACE) -> int:
        """Entries of ns in the tier that holds most of them (tiers overlap, so no sum)."""
        return max(t.count(ns) for t in self.tiers)

    async def drain(self) -> None:
        """Wait until every queued background write has run (tests, orderly shutdown)."""
        if self._queue is not None:
            await self._queue.join()

    async def close(self) -> None:
        await self.drain()
        for w in self._workers:
            w.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers, self._queue = [], None
        for t in self.tiers:
            await t.close()
