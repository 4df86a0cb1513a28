"""The server's data plane operations on one session (protocol in cacheserver.dataplane.protocol):
GET into the session's region, GET with the payloads inline (TCP), STREAM, and PUT.

GET into a region copies each payload once, from the tier holding it (a cpu-tier hit is read
straight into the region); inline, a cpu-tier hit is sent from the tier's own pages, held while
it is sent (storage_backends.page_views), and any other from the segment the store returned.
PUT is cacheserver.dataplane.server_put."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tierkv.cacheserver.dataplane.conn import Conn
from tierkv.cacheserver.dataplane.protocol import (
    FULL,
    HEAD,
    MAX_BODY,
    MAX_KEYS,
    OK,
    REPLY,
    pack,
)
from tierkv.cacheserver.dataplane.region import RangeAllocator, Region
from tierkv.cacheserver.dataplane.stream_server import Outbound
from tierkv.cacheserver.receive import Inflight
from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.cpu_tier import CpuTier
from tierkv.storage_backends.indexed_tier import IndexedTier
from tierkv.storage_backends.names import KEY_NBYTES
from tierkv.storage_backends.store import TieredStore


class Refused(Exception):
    """A malformed request: the session is closed."""


class Busy(Exception):
    """The server's in-flight budget is spent: the session is closed, the client retries."""


@dataclass(slots=True, eq=False)
class Session:
    ns: str
    region: Region | None  # None: a TCP session, whose payloads follow each GET reply
    ranges: RangeAllocator


class Counts(Protocol):
    """Where the server counts what each namespace did (its Stats RPC and metrics)."""

    def count_get(self, ns: str, where: str, nbytes: int) -> None: ...

    def count_put(self, ns: str, nbytes: int) -> None: ...


async def get_into_region(
    store: TieredStore, counts: Counts, s: Session, count: int, body: bytes
) -> bytes:
    """The reply to a GET on a shared-memory session: per key its range and header."""
    out, heads = [], []
    for key in keys_of(count, body):
        off, n, head, where = await _read(store, s, key)
        counts.count_get(s.ns, where, n)
        out.append(REPLY.pack(off, n, len(head)))
        heads.append(head)
    return pack(OK, count, b"".join(out) + b"".join(heads))


async def _read(store: TieredStore, s: Session, key: bytes) -> tuple[int, int, bytes, str]:
    """(offset, payload bytes, encoded header, tier) of key's segment copied into the region,
    (0, 0, b"", "") on a miss, or (FULL, 0, b"", "") when the region has no room (the client
    then loads it over gRPC)."""
    region = s.region
    assert region is not None  # only shared-memory sessions come here
    top = store.tiers[0]
    if isinstance(top, CpuTier):
        hit = _from_pages(top, s, region, key)
        if hit is not None:
            return hit
    entry = top.index.get((s.ns, key)) if isinstance(top, IndexedTier) else None
    head = getattr(entry, "header", None)
    if head is not None and head.codec == "none":  # read straight into the region
        n = head.payload_raw_nbytes
        off = s.ranges.alloc(n)
        if off is None:
            return FULL, 0, b"", ""
        seg, where = await store.get_from(key, s.ns, out=memoryview(region.map)[off : off + n])
        if seg is None:
            s.ranges.release(off)
            return 0, 0, b"", ""
        return off, n, head.encode(), where
    # A slower tier, or a compressed segment: decoded here, then copied into the region.
    seg, where = await store.get_from(key, s.ns)
    if seg is None:
        return 0, 0, b"", ""
    raw = seg.payload.reshape(-1).view(torch.uint8).numpy().data
    off = s.ranges.alloc(len(raw))
    if off is None:
        return FULL, 0, b"", ""
    region.map[off : off + len(raw)] = raw
    copied("shm.copy_in", len(raw))
    return off, len(raw), seg.full_header().encode(), where


def _from_pages(
    top: CpuTier, s: Session, region: Region, key: bytes
) -> tuple[int, int, bytes, str] | None:
    """A cpu-tier hit copied from the tier's pages (held while they are read) straight into the
    region: one memcpy per page run, none of a get's per-call work; None where it is not one
    (absent, compressed, or found corrupt: the store's own get answers then)."""
    entry = top.index.get((s.ns, key))
    if entry is None or entry.header.codec != "none":
        return None
    n = entry.header.payload_raw_nbytes
    off = s.ranges.alloc(n)
    if off is None:
        return FULL, 0, b"", ""
    views = top.payload_views(key, s.ns)
    if views is None:
        s.ranges.release(off)
        return None
    with views:
        dst, pos = memoryview(region.map), off
        for v in views.views:
            dst[pos : pos + len(v)] = v
            pos += len(v)
    copied("shm.copy_in", n)
    return off, n, views.header.encode(), top.name


async def get_inline(
    store: TieredStore, counts: Counts, conn: Conn, s: Session, count: int, body: bytes
) -> None:
    """A GET over TCP: OK, then per key its REPLY, header and payload, one key at a time (the
    server holds one segment per session, however many keys a GET names)."""
    keys = keys_of(count, body)
    ok = pack(OK, count)  # goes out with the first key's reply
    top = store.tiers[0]
    for key in keys:
        # a cpu-tier hit goes out from the tier's pages, held (not copied) while it is sent
        views = top.payload_views(key, s.ns) if isinstance(top, CpuTier) else None
        if views is not None:
            with views:
                head = views.header.encode()
                reply = ok + REPLY.pack(0, views.header.payload_raw_nbytes, len(head)) + head
                await conn.send_views([memoryview(reply), *views.views])
            ok = b""
            counts.count_get(s.ns, top.name, views.header.payload_raw_nbytes)
            continue
        seg, where = await store.get_from(key, s.ns)
        if seg is None:
            counts.count_get(s.ns, "", 0)
            await conn.sendall(ok + REPLY.pack(0, 0, 0))
            ok = b""
            continue
        head = seg.full_header().encode()
        raw = seg.payload.reshape(-1).view(torch.uint8).numpy().data
        await conn.send_views([memoryview(ok + REPLY.pack(0, len(raw), len(head)) + head), raw])
        ok = b""
        counts.count_get(s.ns, where, len(raw))


async def stream(
    store: TieredStore,
    counts: Counts,
    conn: Conn,
    s: Session,
    count: int,
    body: bytes,
    inflight: Inflight,
) -> None:
    """A STREAM: OK, then the store's layer-major stream of the keys as frames (Outbound)."""
    keys = keys_of(count, body)
    await conn.sendall(pack(OK, count))
    out = Outbound(conn, s.region, s.ranges, inflight)
    try:
        where = await store.stream_from(keys, s.ns, out)
        await out.finish()
    finally:
        out.close()
    served = dict(out.done)
    for i, tier in enumerate(where):
        counts.count_get(s.ns, tier if i in served else "", served.get(i, 0))


def keys_of(count: int, body: bytes) -> list[bytes]:
    if not 0 < count <= MAX_KEYS or len(body) != count * KEY_NBYTES:
        raise Refused(f"GET of {count} keys with a body of {len(body)} bytes")
    return [body[i * KEY_NBYTES : (i + 1) * KEY_NBYTES] for i in range(count)]


async def recv_request(conn: Conn) -> tuple[int, int, bytes]:
    op, count, n = HEAD.unpack(await conn.recv_exactly(HEAD.size))
    if n > MAX_BODY:
        raise Refused(f"request body of {n} bytes exceeds {MAX_BODY}")
    return op, count, await conn.recv_exactly(n) if n else b""
