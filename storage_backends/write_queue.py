"""The tiered store's background writes: put into the slower tiers off the caller's path."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.tier import EvictHook, Tier

if TYPE_CHECKING:
    from tierkv.storage_backends.store import StoreStats

log = logging.getLogger(__name__)


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


class WriteQueue:
    """A bounded queue of jobs drained by `workers` tasks; a full queue drops and counts, it
    never waits. A delete of a key cancels its jobs not yet done (a delete is final)."""

    def __init__(self, tiers: Sequence[Tier], size: int, workers: int, stats: StoreStats) -> None:
        self.tiers, self.size, self.nworkers, self.stats = tiers, size, workers, stats
        self.queue: asyncio.Queue[Job] | None = None
        self.workers: list[asyncio.Task] = []
        # evicted, queued for the next tier: (segment, index of that tier)
        self.moving: dict[tuple[str, bytes], tuple[KVSegment, int]] = {}
        self.queued: dict[tuple[str, bytes], int] = {}  # jobs queued or running per key
        self.gen: dict[tuple[str, bytes], int] = {}  # deletes of a key while it had jobs

    def demoter(self, i: int) -> EvictHook:
        """tiers[i]'s on_evict: the evicted segment is queued for tiers[i + 1]."""

        def demote(ns: str, key: bytes, segment: KVSegment) -> None:
            if self.put(Job(ns, key, segment, i, [i + 1], check=True)):
                self.stats.demoted += 1
                self.moving[(ns, key)] = (segment, i + 1)

        return demote

    def put(self, job: Job) -> bool:
        """Queue job; False (counted) when the queue is full."""
        if self.queue is None:
            self.queue = asyncio.Queue(self.size)
            loop = asyncio.get_running_loop()
            self.workers = [loop.create_task(self._work()) for _ in range(self.nworkers)]
        ident = (job.ns, job.key)
        job.gen = self.gen.get(ident, 0)
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            self.stats.dropped += 1
            return False
        self.queued[ident] = self.queued.get(ident, 0) + 1
        self.stats.queued += 1
        return True

    def cancel(self, ns: str, key: bytes) -> bool:
        """Cancel the key's jobs not yet done; whether it was between two tiers."""
        ident = (ns, key)
        if ident in self.queued:
            self.gen[ident] = self.gen.get(ident, 0) + 1
        return self.moving.pop(ident, None) is not None

    async def _work(self) -> None:
        assert self.queue is not None
        while True:
            job = await self.queue.get()
            try:
                await self._run(job)
            except Exception:  # a tier bug must not kill the worker; the write is just lost
                log.exception("background write of %s failed", job.key.hex())
            finally:
                ident = (job.ns, job.key)
                if job.segment is not None and self.moving.get(ident, (None,))[0] is job.segment:
                    del self.moving[ident]
                self.queued[ident] -= 1
                if not self.queued[ident]:
                    del self.queued[ident]
                    self.gen.pop(ident, None)
                self.queue.task_done()

    async def _run(self, job: Job) -> None:
        seg = job.segment
        if seg is None:
            seg = await self.tiers[job.source].get(job.key, job.ns)
            if seg is None:
                self.stats.lost += 1
                return
        for i in job.targets:
            tier = self.tiers[i]
            if self.gen.get((job.ns, job.key), 0) != job.gen:
                return  # deleted after it was queued: a delete is final
            if job.check and (await tier.contains([job.key], job.ns))[0]:
                continue
            if await tier.put(job.key, seg, job.ns):
                self.stats.written += 1
                if self.gen.get((job.ns, job.key), 0) != job.gen:  # deleted while this put ran
                    await tier.delete(job.key, job.ns)

    async def drain(self) -> None:
        """Wait until every queued job has run."""
        if self.queue is not None:
            await self.queue.join()

    async def close(self) -> None:
        await self.drain()
        for w in self.workers:
            w.cancel()
        await asyncio.gather(*self.workers, return_exceptions=True)
        self.workers, self.queue = [], None
