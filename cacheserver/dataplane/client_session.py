"""One client session of the server's data plane (protocol in cacheserver.dataplane.protocol):
its socket, its shared-memory region when the server is on this host, and the GET, PUT and
STREAM exchanges, pipelined (cacheserver.dataplane.pipeline): a request goes out while earlier
replies are still being read, and each reply is read in request order by its own exchange.

Safety contract: every reply is read by the exchange that asked for it and checked against what
was asked (count, key, shape, range inside the region, sizes within the caller's limit) before
a byte is used, and each payload's layer checksums before it is handed out; a region range is
RELEASEd (with a later request) only once nothing reads it any more: a GET's after its payload
was copied out and checked, a STREAM's after the stream returned, so after its sink's last
`ready` (a sink that reads layers in place, `place`, reads them from the range itself, checked
there, and keeps no view past that: cacheserver.dataplane.stream_client); anything that does
not fit raises and breaks the session (every exchange waiting on it raises too), and the
caller drops it (the server frees the whole region when the socket closes)."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tierkv.cacheserver.dataplane.checked_recv import recv_checked
from tierkv.cacheserver.dataplane.conn import Conn
from tierkv.cacheserver.dataplane.pipeline import Pipeline
from tierkv.cacheserver.dataplane.protocol import (
    FRAME,
    FULL,
    GET,
    HEAD,
    HELLO,
    MAX_BODY,
    OK,
    PUT,
    RELEASE,
    REPLY,
    STREAM,
    WELCOME,
    buffer,
    pack,
)
from tierkv.cacheserver.dataplane.region import Region
from tierkv.cacheserver.dataplane.stream_client import Inbound
from tierkv.storage_backends.buffers import copy_into, out_view
from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.segment import KVSegment, SegmentError
from tierkv.storage_backends.stream import LayerSink

Got = tuple[KVSegment, int] | None | Exception  # one key's answer: (segment, bytes), a miss, or why


class Elsewhere(Exception):
    """This key must be loaded over gRPC: the region had no room for it, or the caller's
    `out` lives on a device. Not a fault: the session stays."""


@dataclass(slots=True, eq=False)
class Want:
    key: bytes
    out: Any  # the caller's destination for the payload, or None


def handshake_unix(path: str, token: str, timeout_s: float) -> tuple[socket.socket, int]:
    """Connect to the server's Unix socket, authenticate, and receive the region's fd.
    Blocking: run it in a thread."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.sendall(pack(HELLO, 0, token.encode()))
        msg, fds, _, _ = socket.recv_fds(sock, HEAD.size + 1024, 1)
        code, _, n = HEAD.unpack_from(msg)
        if code != OK or len(fds) != 1:
            for fd in fds:
                socket.close(fd)
            why = msg[HEAD.size : HEAD.size + n].decode(errors="replace")
            raise ConnectionError(f"data plane refused the session: {why}")
        return sock, fds[0]
    except BaseException:
        sock.close()
        raise


async def handshake_tcp(
    host: str,
    port: int,
    token: str,
    timeout_s: float,
    tls: ssl.SSLContext | None,
    kind: type[Conn] = Conn,
) -> tuple[Conn, int]:
    """Connect to the server's TCP data port (TLS when tls is given) and authenticate: the
    connection (a `kind`) and the protocol version the server speaks."""
    loop = asyncio.get_running_loop()
    sock = await loop.run_in_executor(None, socket.create_connection, (host, port), timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = await asyncio.wait_for(kind.open(sock, tls, False, host), timeout_s)
        await conn.sendall(pack(HELLO, 0, token.encode()))
        code, _, n = HEAD.unpack(await asyncio.wait_for(conn.recv_exactly(HEAD.size), timeout_s))
        body = await conn.recv_exactly(min(n, MAX_BODY)) if n else b""
        if code != OK:
            why = body.decode(errors="replace")
            raise ConnectionError(f"data plane refused the session: {why}")
        return conn, WELCOME.unpack_from(body)[1] if len(body) >= WELCOME.size else 1
    except BaseException:
        sock.close()
        raise


@dataclass(slots=True, eq=False)
class Session:
    conn: Conn
    region: Region | None  # None: over TCP, each payload follows its reply
    max_bytes: int  # largest payload accepted from the server
    version: int = 1  # the protocol version the server announced
    released: list[int] = field(default_factory=list)  # offsets to release with the next op
    pipe: Pipeline = field(init=False)

    def __post_init__(self) -> None:
        self.pipe = Pipeline(self.conn, self._free)

    @property
    def broken(self) -> bool:
        return bool(self.pipe.broken)

    @property
    def max_in_flight(self) -> int:
        """The most requests this session had sent at once before their replies were read."""
        return self.pipe.max_in_flight

    def close(self) -> None:
        """Break the session: exchanges in progress wake with an error; the socket closes and
        the region unmaps once the last of them left."""
        self.pipe.close()

    def _free(self) -> None:
        self.conn.close()
        if self.region is not None:
            self.region.close()

    async def put(self, key: bytes, seg: KVSegment) -> bool:
        """Send the encoded segment from its own bytes (the kernel's copy only); whether the
        server stored it."""
        h, head, blobs = seg.encode_parts()
        request = pack(PUT, 1, key + struct.pack("<Q", h.nbytes)) + head
        async with self.pipe.exchange(lambda: [self._releasing() + request, *blobs]):
            code, stored, n = HEAD.unpack(await self.conn.recv_exactly(HEAD.size))
            why = await self.conn.recv_exactly(min(n, MAX_BODY)) if n else b""
            if code != OK:  # the server ends the session after a refusal
                raise ConnectionError(f"data plane refused the put ({code}): {why!r}")
        return bool(stored)

    async def get(self, batch: list[Want]) -> list[Got]:
        """One GET of every key in batch; the answers in order."""
        msg = pack(GET, len(batch), b"".join(w.key for w in batch))
        async with self.pipe.exchange(lambda: [self._releasing() + msg]):
            code, count, n = HEAD.unpack(await self.conn.recv_exactly(HEAD.size))
            if n > len(batch) * (REPLY.size + MAX_BODY):
                raise ValueError(f"data plane reply of {n} bytes for {len(batch)} keys")
            body = memoryview(await self.conn.recv_exactly(n))
            if code != OK or count != len(batch):
                raise ValueError(f"data plane answered {code}: {bytes(body[:200])!r}")
            if self.region is None:
                return [await self._inline(w) for w in batch]
            return self._ranges(batch, body)  # in turn: the ranges join the next request

    async def stream(self, keys: Sequence[bytes], sink: LayerSink) -> Inbound:
        """One STREAM of keys into sink; what arrived. Raises when the session broke (the
        caller drops every key still open, `Inbound.fail`)."""
        got = Inbound(keys, sink, self.region, self.max_bytes)
        msg = pack(STREAM, len(keys), b"".join(keys))
        try:
            async with self.pipe.exchange(lambda: [self._releasing() + msg]):
                try:
                    code, count, n = HEAD.unpack(await self.conn.recv_exactly(HEAD.size))
                    if code != OK or count != len(keys) or n:
                        why = await self.conn.recv_exactly(min(n, MAX_BODY)) if n else b""
                        raise ValueError(f"data plane answered {code} to a stream: {why[:200]!r}")
                    while not got.finished:
                        frame = FRAME.unpack(await self.conn.recv_exactly(FRAME.size))
                        await got.frame(self.conn, *frame)
                finally:
                    self.released += got.released
        except BaseException as e:
            got.fail(f"data plane stream failed: {e!r}")
            raise
        return got

    def _releasing(self) -> bytes:
        """A RELEASE of the ranges read since the last op, to send ahead of the next."""
        if not self.released:
            return b""
        rel = struct.pack(f"<{len(self.released)}Q", *self.released)
        self.released.clear()
        return pack(RELEASE, len(rel) // 8, rel)

    def _ranges(self, batch: list[Want], body: memoryview) -> list[Got]:
        if len(body) < len(batch) * REPLY.size:
            raise ValueError("data plane reply too short for its keys")
        out: list[Got] = []
        pos = len(batch) * REPLY.size
        for i, w in enumerate(batch):
            off, size, hlen = REPLY.unpack_from(body, i * REPLY.size)
            head, pos = body[pos : pos + hlen], pos + hlen
            if size == 0:
                out.append(Elsewhere("no room in the region") if off == FULL else None)
                continue
            try:
                out.append(self._take(w, off, size, head))
            except (ValueError, SegmentError, Elsewhere) as e:
                out.append(e)
            finally:
                self.released.append(off)
        return out

    def _take(self, w: Want, off: int, size: int, head: memoryview) -> Got:
        """The one copy in this process: the payload out of the region, then checked."""
        h = SegmentHeader.decode(head)
        assert self.region is not None
        if h.key != w.key or h.payload_raw_nbytes != size or off + size > self.region.size:
            raise ValueError("data plane answered a range that does not fit the segment")
        into = buffer(size) if w.out is None else out_view(w.out, size)
        if into is None:  # a device tensor: the caller's gRPC path copies into it
            raise Elsewhere("out is on a device")
        # One memcpy on this thread: torch's threaded copy stalls whenever another process
        # (or the engine's own forward) holds the cores its threads wait for.
        into[:] = memoryview(self.region.map)[off : off + size]
        copied("shm.copy_out", size)
        seg = KVSegment.from_raw(h, into, verify=True)
        return seg, seg.nbytes

    async def _inline(self, w: Want) -> Got:
        """One key's answer over TCP: REPLY, header and payload, received straight into the
        segment's buffer (or the caller's `out`) and checked layer by layer as it arrives."""
        _, size, hlen = REPLY.unpack(await self.conn.recv_exactly(REPLY.size))
        if size == 0:
            return None
        if size > self.max_bytes or not 0 < hlen <= MAX_BODY:
            raise ValueError(f"data plane announced {size} payload and {hlen} header bytes")
        h = SegmentHeader.decode(await self.conn.recv_exactly(hlen))
        if h.key != w.key or h.payload_raw_nbytes != size:
            raise ValueError("data plane answered a payload that does not fit the segment")
        into = None if w.out is None else out_view(w.out, size)
        buf = buffer(size) if into is None else into
        bad = await recv_checked(self.conn, h, buf)
        if bad:
            return SegmentError(f"layer {bad[0]}: checksum mismatch")
        seg = KVSegment.from_raw(h, buf, verify=False)
        seg.verified = True  # recv_checked checked every layer
        if w.out is not None and into is None:  # a device tensor
            seg = copy_into(seg, w.out)
        return seg, seg.nbytes
