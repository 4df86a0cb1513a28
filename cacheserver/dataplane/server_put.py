"""The server's side of a data plane PUT (protocol in cacheserver.dataplane.protocol): the
encoded segment's header first, then its layers straight into the cpu tier's pages where it can
land there (storage_backends.page_landing), else into one buffer.

Safety contract: memory is taken from the in-flight budget as bytes arrive (past it: Busy), and
cpu-tier pages only as they arrive too; the header is checked before any payload byte is read,
every layer's checksum before the segment is stored, and a segment failing a check is refused
(the session closes) with whatever it took given back."""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

from tierkv.cacheserver.dataplane.conn import Conn
from tierkv.cacheserver.dataplane.protocol import OK, buffer, pack
from tierkv.cacheserver.dataplane.server_ops import Busy, Counts, Refused, Session
from tierkv.cacheserver.frames import BadRequest
from tierkv.cacheserver.receive import Inflight
from tierkv.storage_backends.cpu_tier import CpuTier
from tierkv.storage_backends.header import PREFIX_NBYTES
from tierkv.storage_backends.names import KEY_NBYTES
from tierkv.storage_backends.page_landing import Landing
from tierkv.storage_backends.segment import KVSegment, SegmentError, SegmentHeader
from tierkv.storage_backends.sizes import MiB
from tierkv.storage_backends.store import TieredStore


@dataclass(slots=True)
class Budget:
    """The bytes of one PUT taken from the server's in-flight budget, given back at its end."""

    inflight: Inflight
    taken: int = 0

    async def recv(self, conn: Conn, view: memoryview) -> None:
        """Fill view from the socket, taking its bytes from the budget a MiB at a time."""
        for at in range(0, len(view), MiB):
            step = view[at : at + MiB]
            try:
                self.inflight.take(len(step))
            except BadRequest as e:
                raise Busy(e.message) from None
            self.taken += len(step)
            await conn.recv_into(step)

    def give(self) -> None:
        self.inflight.give(self.taken)
        self.taken = 0


async def put(
    store: TieredStore,
    counts: Counts,
    conn: Conn,
    s: Session,
    body: bytes,
    max_segment_bytes: int,
    inflight: Inflight,
) -> bytes:
    """Receive one PUT's encoded segment, check it, store it; the reply."""
    if len(body) != KEY_NBYTES + 8:
        raise Refused(f"PUT body of {len(body)} bytes: expected a key and a length")
    key, (total,) = body[:KEY_NBYTES], struct.unpack("<Q", body[KEY_NBYTES:])
    if not PREFIX_NBYTES <= total <= max_segment_bytes:
        raise Refused(f"PUT of {total} bytes; max_segment_bytes is {max_segment_bytes}")
    budget = Budget(inflight)
    try:
        head = await _header(conn, budget, key, total)
        top = store.tiers[0]
        landing = top.land(key, s.ns, head[1]) if isinstance(top, CpuTier) else None
        if landing is None:
            stored = await _into_buffer(store, conn, budget, s.ns, head)
        else:
            stored = await _into_pages(store, conn, budget, landing, head[0])
        counts.count_put(s.ns, total)
    finally:
        budget.give()
    return pack(OK, int(stored))


async def _header(
    conn: Conn, budget: Budget, key: bytes, total: int
) -> tuple[bytearray, SegmentHeader]:
    """The segment's header bytes and the header, checked against the PUT's key and length."""
    prefix = bytearray(PREFIX_NBYTES)
    await budget.recv(conn, memoryview(prefix))
    try:
        hn = SegmentHeader.peek_nbytes(prefix)
        if hn > total:
            raise SegmentError(f"a header of {hn} bytes in a segment of {total}")
        raw = prefix + bytearray(hn - PREFIX_NBYTES)
        await budget.recv(conn, memoryview(raw)[PREFIX_NBYTES:])
        h = SegmentHeader.decode(raw)
    except SegmentError as e:
        raise Refused(f"malformed segment: {e}") from None
    if h.key != key:
        raise Refused("the segment's own key differs from the PUT's key")
    if h.nbytes != total:
        raise Refused(f"malformed segment: {total} bytes, its header says {h.nbytes}")
    return raw, h


async def _into_buffer(
    store: TieredStore,
    conn: Conn,
    budget: Budget,
    ns: str,
    head: tuple[bytearray, SegmentHeader],
) -> bool:
    """The rest of the segment into one buffer (virtual memory only: pages become resident as
    bytes arrive), checked whole, then handed to the store, which keeps it."""
    raw, h = head
    buf = buffer(h.nbytes)
    buf[: len(raw)] = raw
    await budget.recv(conn, buf[len(raw) :])
    try:
        seg = KVSegment.from_parts(h, buf, verify=True)
    except SegmentError as e:
        raise Refused(f"malformed segment: {e}") from None
    seg.owned = True  # the buffer is this segment's alone
    return bool(await asyncio.shield(store.put(h.key, seg, ns)))


async def _into_pages(
    store: TieredStore, conn: Conn, budget: Budget, landing: Landing, raw: bytearray
) -> bool:
    """Each layer straight into the cpu tier's pages, taken as it arrives and checked once in;
    when the tier runs out of room midway the rest is read and dropped (not stored)."""
    h = landing.header
    try:
        if not landing.grow(len(raw)):
            return await _drain(conn, budget, len(raw), h.nbytes)
        _fill(landing.views(0, len(raw)), memoryview(raw))
        for i, (off, n) in enumerate(h.layers):
            if not landing.grow(off + n):
                return await _drain(conn, budget, off, h.nbytes)
            views = landing.views(off, off + n)
            for v in views:
                await budget.recv(conn, v)
            if not landing.checked(i, views):
                raise Refused(f"malformed segment: layer {i}: checksum mismatch")
        if not landing.commit():
            return False
        store.landed(h.key, landing.ns)
        return True
    finally:
        landing.abort()  # a no-op once committed


def _fill(views: list[memoryview], src: memoryview) -> None:
    at = 0
    for v in views:
        v[:] = src[at : at + len(v)]
        at += len(v)


async def _drain(conn: Conn, budget: Budget, start: int, stop: int) -> bool:
    """Bytes [start, stop) of a segment that will not be stored: read, then given back."""
    scratch = buffer(min(MiB, stop - start))
    while start < stop:
        step = scratch[: min(len(scratch), stop - start)]
        await budget.recv(conn, step)
        budget.give()
        start += len(step)
    return False
