"""Striped loads over the TCP data port: one DataTier session spread over `count` connections,
each its own authenticated session (the tier's main session and count - 1 more, opened on the
first striped load), so that the kernel's copies of several connections run at once (their
large receives in worker threads, cacheserver.dataplane.stripe_io).

A STREAM of several keys is split into contiguous shares, one STREAM per connection, merged
into the caller's sink layer by layer (`Merge`). A get of one large key into a CPU `out` asks
each connection for a share of its layers (GET_PART) and receives every share straight into
`out`.

Safety contract: the caller's sink sees exactly the LayerSink contract of one STREAM: each
key opened once with its checked header, its layers written only into `into` and checked before
`ready(layer)`, which is awaited once per layer, in order, after that layer of every live key
of every share arrived; no share writes layer l + 1 before ready(l) returned. A striped get
hands out a segment only when every share answered with the same header and every layer
checked out; shares of different headers (an overwrite raced the shares) or a share missing
(a delete raced them) are a miss. A connection that fails breaks every connection of the
load, and the caller drops them all (its gRPC fallback), as for one session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierkv.cacheserver.dataplane.client_session import Session
from tierkv.cacheserver.dataplane.stripe_io import get_part
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.segment import KVSegment, SegmentError
from tierkv.storage_backends.stream import LayerSink

PASSED = 1 << 30  # a share with no key left live has passed every layer


@dataclass(slots=True, eq=False)
class Stripes:
    """The extra sessions of one DataTier (its main session is the first stripe)."""

    count: int  # connections per load, the main session's included
    connect: Callable[[], Awaitable[Session]]  # one more authenticated TCP session
    extra: list[Session] = field(default_factory=list)
    opening: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def up(self, main: Session) -> list[Session]:
        """Every stripe's session, the extra ones opened on first use."""
        async with self.opening:
            while len(self.extra) < self.count - 1:
                self.extra.append(await self.connect())
        return [main, *self.extra]

    def close(self) -> None:
        for s in self.extra:
            s.close()
        self.extra.clear()


async def striped_get(
    sessions: list[Session], key: bytes, buf: memoryview
) -> tuple[KVSegment, int] | None:
    """key's payload, one share of its layers per session, received into buf (the caller's
    CPU `out`); None on a miss. Raises when a session failed (all of them are broken then)."""
    parts = len(sessions)
    got = await _all([get_part(s, key, p, parts, buf) for p, s in enumerate(sessions)], sessions)
    heads = [g.header for g in got]
    h = heads[0]
    if h is None or any(x is None or x.encode() != h.encode() for x in heads):
        return None  # missing, or a delete or an overwrite raced the shares
    bad = sorted(layer for g in got for layer in g.bad)
    if bad:
        raise SegmentError(f"layer {bad[0]}: checksum mismatch")
    seg = KVSegment.from_raw(h, buf[: h.payload_raw_nbytes], verify=False)
    seg.verified = True  # every share checked each of its layers
    return seg, seg.nbytes


async def striped_stream(
    sessions: list[Session], keys: Sequence[bytes], sink: LayerSink
) -> tuple[int, int]:
    """One STREAM per session of a contiguous share of keys, merged into sink: (keys served
    whole, bytes). Raises when a session failed (every key still open is dropped)."""
    n = min(len(sessions), len(keys))
    cut = [len(keys) * i // n for i in range(n + 1)]
    merge = Merge(sink, [0] * n)

    async def share(i: int) -> tuple[int, int]:
        sub = Share(merge, i, cut[i], cut[i + 1] - cut[i])
        try:
            got = await sessions[i].stream(keys[cut[i] : cut[i + 1]], sub)
            return got.hits, got.nbytes
        finally:
            merge.passed[i] = PASSED
            merge.wake()
            await merge.advance()

    got = await _all([share(i) for i in range(n)], sessions[:n])
    return sum(g[0] for g in got), sum(g[1] for g in got)


async def _all(aws: list[Awaitable[Any]], sessions: list[Session]) -> list[Any]:
    """Every result, or the first failure once all ended: a failure breaks every session
    (the others' receives end at once)."""

    async def one(a: Awaitable[Any]) -> Any:
        try:
            return await a
        except BaseException:
            for s in sessions:
                s.close()
            raise

    got = await asyncio.gather(*(one(a) for a in aws), return_exceptions=True)
    for g in got:
        if isinstance(g, BaseException):
            raise g
    return got


@dataclass(slots=True, eq=False)
class Merge:
    """The caller's sink behind several shares: layer l is made ready once every share has
    passed it (made it ready on its side, or has no key left live)."""

    sink: LayerSink
    passed: list[int]  # per share: the layers it made ready (PASSED: all)
    layers: int = 0  # the stream's layer count (its first header's)
    delivered: set[int] = field(default_factory=set)  # layers some share made ready
    next: int = 0  # the next layer to make ready on the caller's sink
    advancing: bool = False
    error: BaseException | None = None
    moved: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        self.moved.set()
        self.moved = asyncio.Event()

    async def advance(self) -> None:
        """Make ready every layer all shares passed (one task at a time; the others wait)."""
        if self.advancing or self.error is not None:
            return
        self.advancing = True
        try:
            while self.layers and self.next < self.layers and min(self.passed) > self.next:
                if self.next in self.delivered:
                    await self.sink.ready(self.next)
                self.next += 1
                self.wake()
        except BaseException as e:
            self.error = e
            self.wake()
            raise
        finally:
            self.advancing = False

    async def ready(self, share: int, layer: int) -> None:
        self.passed[share] = layer + 1
        self.delivered.add(layer)
        self.wake()
        while self.next <= layer:
            if self.error is not None:
                raise ConnectionError(f"another share's ready failed: {self.error!r}")
            await self.advance()
            if self.next <= layer and self.error is None:
                await self.moved.wait()


@dataclass(slots=True, eq=False)
class Share:
    """One share's view of the caller's sink: keys [at, at + n) of the stream."""

    merge: Merge
    i: int
    at: int
    n: int
    dropped: int = 0

    def open(self, i: int, header: SegmentHeader) -> bool:
        m = self.merge
        m.layers = m.layers or header.num_layers
        return header.num_layers == m.layers and m.sink.open(self.at + i, header)

    def into(self, i: int, layer: int) -> memoryview:
        return self.merge.sink.into(self.at + i, layer)

    def drop(self, i: int, why: str) -> None:
        self.merge.sink.drop(self.at + i, why)
        self.dropped += 1
        if self.dropped == self.n:  # nothing of this share is made ready any more
            self.merge.passed[self.i] = PASSED
            self.merge.wake()

    async def ready(self, layer: int) -> None:
        await self.merge.ready(self.i, layer)
