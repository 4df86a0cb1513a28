"""DataTier: RemoteTier whose loads and saves move over the server's data plane
(cacheserver.dataplane.protocol): shared memory with a server on this host, the server's TCP
data port with one elsewhere. Lookups and deletes stay on gRPC.

Concurrent reads share GETs (cacheserver.batch), and GETs overlap on the one session
(cacheserver.dataplane.pipeline): up to DEPTH in flight, their replies read in order.

Safety contract: RemoteTier's, and: the session authenticates with this tier's token; a
payload is copied out of the region (or received from the socket) and its layer checksums
checked before the range is released or the segment handed out; when the data plane is off,
unreachable or fails, loads and saves go over gRPC (the session is dropped, with every exchange
still in flight on it, and retried after `retry_s`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tierkv.cacheserver.batch import Batcher
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.dataplane.client_session import (
    Elsewhere,
    Session,
    Want,
    handshake_tcp,
    handshake_unix,
)
from tierkv.cacheserver.dataplane.conn import Conn, tls_context
from tierkv.cacheserver.dataplane.protocol import MAX_KEYS
from tierkv.cacheserver.dataplane.region import Region
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.names import check_key, check_namespace
from tierkv.storage_backends.segment import KVSegment, SegmentError
from tierkv.storage_backends.stream import LayerSink

log = logging.getLogger("tierkv.remote")
# GETs in flight on one session. A read that arrives while one is in flight goes out at once
# as a GET of its own: the server answers in order on the one socket, so it starts on it as
# soon as the earlier reply is out, where a batch held back would wait for that whole reply
# plus a round trip; merging saves only a request header. Past this depth reads merge again
# (into the batch sent when one lands), which bounds the region ranges held at once.
DEPTH = 4
FAULTS = (OSError, EOFError, ValueError, SegmentError, asyncio.TimeoutError, ssl.SSLError)


@dataclass(slots=True, eq=False)
class DataTier(RemoteTier):
    # Shared memory when the server announces a Unix socket and runs on this host (the
    # connector decides that from the target); else the server's TCP data port.
    shared_memory: bool = True
    retry_s: float = 5.0  # after a data plane failure, loads and saves use gRPC this long
    name: str = "remote"
    _session: Session | None = None
    _down_until: float = 0.0
    _opening: asyncio.Lock = field(default_factory=asyncio.Lock)
    _batch: Batcher[Want, tuple[KVSegment, int] | None] | None = None  # reads -> one GET

    def __post_init__(self) -> None:
        self._start_stats(device="shm")

    @property
    def session_open(self) -> bool:
        """Whether a data plane session is open: loads and saves take the data plane, not gRPC."""
        return self._session is not None

    async def _open(self) -> Session | None:
        r = await self._retry(
            "data plane", lambda: self.stub.DataPlane(pb.DataPlaneRequest(), **self._opts())
        )
        if r is None:
            return None
        loop, token = asyncio.get_running_loop(), self.token or ""
        if self.shared_memory and r.unix_socket:
            sock, fd = await loop.run_in_executor(
                None, handshake_unix, r.unix_socket, token, self.timeout_s
            )
            conn = await Conn.open(sock, None, False)
            return Session(conn, Region.attach(fd), self.max_segment_bytes)
        if r.tcp_port:
            host = self.target.rsplit(":", 1)[0].strip("[]")
            tls = None if self.tls_ca is None else tls_context(self.tls_ca)
            conn = await handshake_tcp(host, r.tcp_port, token, self.timeout_s, tls)
            return Session(conn, None, self.max_segment_bytes)
        return None

    async def _session_up(self) -> Session | None:
        """The session, opened on first use (the first calls arrive together: one session)."""
        if time.monotonic() < self._down_until:
            return None
        if self._session is None:
            async with self._opening:
                if self._session is None:
                    self._session = await self._open()
            if self._session is None:
                self._down_until = time.monotonic() + self.retry_s
        return self._session

    def _drop(self, op: str, e: BaseException, s: Session | None) -> None:
        """Drop session s after its failure (and the current one if it broke meanwhile: a
        failure that lands late never drops a session opened since)."""
        self._fail(f"data plane {op}", e)
        cur = self._session
        if cur is not None and (cur is s or cur.broken):
            self._down_until = time.monotonic() + self.retry_s
            cur.close()
            self._session = None
        elif s is None:
            self._down_until = time.monotonic() + self.retry_s

    async def _read(self, ns: str, key: bytes, out: Any) -> tuple[KVSegment, int] | None:
        s = None
        try:
            s = await self._session_up()
            if s is not None:
                if self._batch is None:
                    self._batch = Batcher(self._exchange, MAX_KEYS, DEPTH)
                async with asyncio.timeout(self.timeout_s):  # no task of its own, as wait_for's
                    return await self._batch.submit(Want(key, out))
        except Elsewhere:
            pass
        except FAULTS as e:
            self._drop("get", e, s)
        return await RemoteTier._read(self, ns, key, out)  # off, elsewhere or failed: gRPC

    async def _exchange(self, batch: list[Want]) -> list[tuple[KVSegment, int] | None | Exception]:
        """Concurrent reads (a request's chunks) share one GET and one reply; GETs of reads
        that arrive later overlap it (DEPTH)."""
        if self._session is None:
            raise ConnectionError("data plane session closed")
        return await self._session.get(batch)

    async def stream(self, keys: Sequence[bytes], ns: str, sink: LayerSink) -> None:
        """One STREAM over the data plane (gRPC streams per key when it is off or down). A
        session that breaks midway drops the keys still open: their layers may already be in
        the sink, so they are not asked again."""
        check_namespace(ns)
        for k in keys:
            check_key(k)
        s = None
        try:
            s = await self._session_up()
        except FAULTS as e:
            self._drop("stream", e, None)
        if s is None:
            await RemoteTier.stream(self, keys, ns, sink)
            return
        t0 = time.perf_counter()
        try:
            got = await s.stream(keys, sink)
        except FAULTS as e:
            self._drop("stream", e, s)
            return
        except BaseException:  # cancelled midway: the session's framing is lost
            self._drop("stream", asyncio.CancelledError(), s)
            raise
        self._stats.hits += got.hits
        self._stats.misses += len(keys) - got.hits
        self._stats.bytes_out += got.nbytes
        self._get_lat.add(time.perf_counter() - t0)

    async def _write(self, ns: str, key: bytes, segment: KVSegment) -> int | None:
        s = None
        try:
            s = await self._session_up()
            if s is not None:
                async with asyncio.timeout(self.timeout_s):
                    stored = await s.put(key, segment)
                return segment.nbytes if stored else None
        except FAULTS as e:
            self._drop("put", e, s)
        return await RemoteTier._write(self, ns, key, segment)

    async def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
        await RemoteTier.close(self)
