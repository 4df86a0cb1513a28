"""A step's load as one layer-major stream: every distinct chunk key of every plan asked at once
(`Tier.stream`), each layer landing in pooled staging and scattered into the paged cache as
soon as every chunk delivered it, so the forward of layer l overlaps the transfer of l+1...

Safety contract: the transfer module's; besides, a chunk's header is checked against the plan
(key, parent, fingerprint, tokens, shape, dtype) before a byte of it is received, and a layer
is scattered only once the stream checked its checksum. A chunk that fails midway stops its
plan there (`failed_from`): layers already scattered are recomputed with the rest.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from tierkv.connector.plan import ConnectorStats
from tierkv.connector.transfer import Layout, LoadJob, Scatter, why_unusable
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.tier import Tier

log = logging.getLogger("tierkv.connector")


@dataclass(slots=True, eq=False)
class StagingPool:
    """Load staging buffers kept between steps, up to `max_bytes` (pinned with CUDA, so the
    copies into the device cache can run asynchronously). Thread-safe."""

    max_bytes: int
    free: defaultdict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    held: int = 0  # bytes of free buffers
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, n: int) -> torch.Tensor:
        with self.lock:
            if self.free[n]:
                self.held -= n
                return self.free[n].pop()
        return torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def give(self, bufs: list[torch.Tensor]) -> None:
        with self.lock:
            for b in bufs:
                if self.held + b.numel() <= self.max_bytes:
                    self.free[b.numel()].append(b)
                    self.held += b.numel()


class Stop(Exception):
    """The job was cancelled: the stream stops at its next layer."""


@dataclass(slots=True, eq=False)
class Loading:
    """The LayerSink of one step's load."""

    job: LoadJob
    layout: Layout
    scatter: Scatter
    stats: ConnectorStats
    pool: StagingPool
    keys: list[bytes] = field(default_factory=list)
    users: list[list[tuple[int, int]]] = field(default_factory=list)  # key -> (plan, chunk)s
    at: list[list[int]] = field(default_factory=list)  # plan -> its chunks' key indexes
    segs: list[KVSegment | None] = field(default_factory=list)  # key -> over its staging
    views: dict[int, tuple[memoryview, int]] = field(default_factory=dict)  # key -> bytes, layer
    bufs: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        where: dict[bytes, int] = {}
        for p, plan in enumerate(self.job.plans):
            self.at.append([])
            for c, chunk in enumerate(plan.chunks):
                i = where.setdefault(chunk.key, len(self.keys))
                if i == len(self.keys):
                    self.keys.append(chunk.key)
                    self.users.append([])
                self.users[i].append((p, c))
                self.at[p].append(i)
        self.segs = [None] * len(self.keys)

    def open(self, i: int, header: SegmentHeader) -> bool:
        for p, c in self.users[i]:
            why = why_unusable(header, self.job.plans[p], c, self.layout)
            if why is not None:
                self._fail(i, why)
                self.stats.load_rejected += 1
                return False
        buf = self.pool.take(header.payload_raw_nbytes)
        self.bufs.append(buf)
        raw = buf.numpy().data
        # layer l is raw[l*n : (l+1)*n]: a slice per frame, not tensor views (6 us a frame)
        self.views[i] = (raw, header.layer_raw_nbytes)
        seg = KVSegment.from_raw(header, raw, verify=False)
        seg.verified = True  # each layer is checked by the stream before it is made ready
        self.segs[i] = seg
        return True

    def into(self, i: int, layer: int) -> memoryview:
        assert self.segs[i] is not None
        raw, n = self.views[i]
        return raw[layer * n : (layer + 1) * n]

    def drop(self, i: int, why: str) -> None:
        if why == "refused":  # open() counted and logged it
            return
        if why.startswith("miss"):  # absent, or found corrupt by the tier: its miss
            self.stats.load_misses += 1
        elif why.startswith(("tier error", "data plane")):
            self.stats.load_errors += 1
        else:  # a reply that does not fit what was asked
            self.stats.load_rejected += 1
        self._fail(i, why)

    def _fail(self, i: int, why: str) -> None:
        self.segs[i] = None
        for p, c in self.users[i]:
            plan = self.job.plans[p]
            start = max(plan.start, plan.chunks[c].start)
            if plan.failed_from is None or start < plan.failed_from:
                plan.failed_from = start
                log.warning(
                    "load of request %s chunk %d failed: %s; recomputing",
                    plan.request_id,
                    plan.chunks[c].index,
                    why,
                )

    def good(self) -> list[list[KVSegment]]:
        """Per plan, its chunks' segments up to its first failed one."""
        out = []
        for plan, at in zip(self.job.plans, self.at):
            segs: list[KVSegment] = []
            for chunk, i in zip(plan.chunks, at):
                seg = self.segs[i]
                stop = plan.end if plan.failed_from is None else plan.failed_from
                if seg is None or chunk.start >= stop:
                    break
                segs.append(seg)
            out.append(segs)
        return out

    async def ready(self, layer: int) -> None:
        job = self.job
        with job.lock:
            if job.cancelled:
                raise Stop
            if job.staged is not None:  # the engine's thread scatters it in wait_layer
                job.staged[layer] = self.good()
            else:
                job.scattering = True
                self.scatter(self.good(), layer)
        job.events[layer].set()


async def run_load(
    job: LoadJob,
    store: Tier,
    ns: str,
    layout: Layout,
    scatter: Scatter,
    stats: ConnectorStats,
    timeout: float,
    pool: StagingPool | None = None,
) -> None:
    """Stream every plan's chunks; `scatter` writes one layer of every plan into the engine's
    own paged layout, and each layer's event is set after it."""
    sink = Loading(job, layout, scatter, stats, pool or StagingPool(0))
    try:
        await asyncio.wait_for(store.stream(sink.keys, ns, sink), timeout)
        stats.loaded_bytes += sum(s.payload.nbytes for s in sink.segs if s is not None)
        stats.record(stats.load_seconds, time.perf_counter() - job.started)
    except Stop:
        pass
    except asyncio.TimeoutError:
        stats.load_timeouts += 1
        log.warning("connector load timed out after %.1fs; recomputing", timeout)
        job.cancel()
    except Exception as e:  # a fault anywhere is a recompute, never a failed request
        stats.load_errors += 1
        log.warning("connector load failed (%r); recomputing", e)
        job.cancel()
    finally:
        for ev in job.events:
            ev.set()
        sink.segs, sink.views = [], {}
        sink.pool.give(sink.bufs)
