"""DataTier: RemoteTier whose loads and saves move over the server's data plane
(cacheserver.dataplane.protocol): shared memory with a server on this host, the server's TCP
data port with one elsewhere. Lookups and deletes stay on gRPC.

Concurrent reads share GETs (cacheserver.batch), and GETs overlap on the one session
(cacheserver.dataplane.pipeline): up to DEPTH in flight, their replies read in order.

Safety contract: RemoteTier's, and: the session authenticates with this tier's token; a
payload is copied out of the region (or received from the socket) and its layer checksums
checked before the range is released or the segment handed out; when the data plane is off,
unreachable or fails, loads and saves go over gRPC (the session is dropped, with every exchange
still in flight on it, and retried after `retry_s`). With `stripes` > 1 over TCP, STREAMs of
several keys and gets of large keys spread over that many connections
(cacheserver.dataplane.stripes); a failure on any of them drops them all, as one session.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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
from tierkv.cacheserver.dataplane.protocol import MAX_KEYS, MAX_PARTS
from tierkv.cacheserver.dataplane.region import Region
from tierkv.cacheserver.dataplane.stripe_io import StripeConn
from tierkv.cacheserver.dataplane.stripes import Stripes, striped_get, striped_stream
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.buffers import out_view
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
    # Connections per session over the TCP port (1..MAX_PARTS): with more than 1, a STREAM of
    # several keys is split over them and a get of at least stripe_min_bytes into a CPU `out`
    # takes a share of its layers on each, their large receives in worker threads. 1: one
    # connection, every receive on the event loop.
    stripes: int = 1
    stripe_min_bytes: int = 8 << 20
    name: str = "remote"
    _session: Session | None = None
    _stripes: Stripes | None = None
    _tcp: tuple[str, int] = ("", 0)  # the TCP data port the session reached
    _pool: ThreadPoolExecutor | None = None  # the stripes' receiving threads
    _down_until: float = 0.0
    _opening: asyncio.Lock = field(default_factory=asyncio.Lock)
    _batch: Batcher[Want, tuple[KVSegment, int] | None] | None = None  # reads -> one GET

    def __post_init__(self) -> None:
        if not 1 <= self.stripes <= MAX_PARTS:
            raise ValueError(f"stripes must be 1..{MAX_PARTS}, not {self.stripes}")
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
            self._tcp = (self.target.rsplit(":", 1)[0].strip("[]"), r.tcp_port)
            return await self._connect()
        return None

    async def _connect(self) -> Session:
        """A session on the TCP data port (one stripe of it when stripes > 1)."""
        tls = None if self.tls_ca is None else tls_context(self.tls_ca)
        kind = Conn if self.stripes == 1 else StripeConn
        host, port = self._tcp
        conn, version = await handshake_tcp(host, port, self.token or "", self.timeout_s, tls, kind)
        if isinstance(conn, StripeConn):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.stripes, thread_name_prefix="tierkv-stripe")
            conn.pool = self._pool
        return Session(conn, None, self.max_segment_bytes, version=version)

    async def _striped(self, s: Session) -> list[Session] | None:
        """Every stripe's session when s is striped over TCP (the extra ones opened now)."""
        if self.stripes == 1 or s.region is not None:
            return None
        if self._stripes is None:
            self._stripes = Stripes(self.stripes, self._connect)
        return await self._stripes.up(s)

    def _big(self, s: Session, out: Any) -> memoryview | None:
        """out's bytes when a get into it is striped: a CPU out of stripe_min_bytes or more."""
        if self.stripes == 1 or s.region is not None or s.version < 2 or out is None:
            return None
        n = out.numel() * out.element_size() if hasattr(out, "numel") else memoryview(out).nbytes
        return out_view(out, n) if n >= self.stripe_min_bytes else None

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
            if self._stripes is not None:
                self._stripes.close()
        elif s is None:
            self._down_until = time.monotonic() + self.retry_s

    async def _read(self, ns: str, key: bytes, out: Any) -> tuple[KVSegment, int] | None:
        s = None
        try:
            s = await self._session_up()
            if s is not None and (buf := self._big(s, out)) is not None:
                sessions = await self._striped(s)
                assert sessions is not None
                async with asyncio.timeout(self.timeout_s):
                    return await striped_get(sessions, key, buf)
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
        s, sessions = None, None
        try:
            s = await self._session_up()
            if s is not None and len(keys) > 1:
                sessions = await self._striped(s)
        except FAULTS as e:
            self._drop("stream", e, s)
            s = None
        if s is None:
            await RemoteTier.stream(self, keys, ns, sink)
            return
        t0 = time.perf_counter()
        try:
            if sessions is None:
                got = await s.stream(keys, sink)
                hits, nbytes = got.hits, got.nbytes
            else:
                hits, nbytes = await striped_stream(sessions, keys, sink)
        except FAULTS as e:
            self._drop("stream", e, s)
            return
        except BaseException:  # cancelled midway: the session's framing is lost
            self._drop("stream", asyncio.CancelledError(), s)
            raise
        self._stats.hits += hits
        self._stats.misses += len(keys) - hits
        self._stats.bytes_out += nbytes
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
        if self._stripes is not None:
            self._stripes.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        await RemoteTier.close(self)
