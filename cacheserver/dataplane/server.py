"""The server's data plane: loads and saves over shared memory, one session per Unix socket
connection, and for other hosts over a TCP port with the payload inline (protocol and safety
contract in cacheserver.dataplane.protocol, the operations in cacheserver.dataplane.server_ops).

Sessions are bounded (`max_sessions`), each region is `shm_region_bytes`, and a session's
region is unmapped and closed when its socket closes. PUTs take memory from the server's one
in-flight budget (the same as gRPC Puts) as their bytes arrive.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import gc
import logging
import os
import socket
import ssl
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.cacheserver.auth import Auth
from tierkv.cacheserver.dataplane import server_ops as ops
from tierkv.cacheserver.dataplane import server_part, server_put
from tierkv.cacheserver.dataplane.conn import Conn
from tierkv.cacheserver.dataplane.protocol import (
    BAD_REQUEST,
    BUSY,
    GET,
    GET_PART,
    HELLO,
    OK,
    PUT,
    RELEASE,
    STREAM,
    UNAUTHENTICATED,
    VERSION,
    WELCOME,
    pack,
)
from tierkv.cacheserver.dataplane.region import ALIGN, RangeAllocator, Region
from tierkv.cacheserver.dataplane.server_ops import Busy, Refused, Session, recv_request
from tierkv.cacheserver.receive import Inflight
from tierkv.storage_backends.store import TieredStore

log = logging.getLogger("tierkv.dataplane")


@dataclass(slots=True, eq=False)
class DataPlane:
    store: TieredStore
    auth: Auth
    path: Path | None  # the Unix socket of the shared-memory path; None: off
    region_bytes: int
    max_sessions: int
    inflight: Inflight  # the server-wide budget of bytes being received (shared with gRPC)
    counts: ops.Counts  # per-namespace gets and puts, reported by Stats as gRPC's are
    max_segment_bytes: int  # the largest segment a PUT may carry
    tcp: tuple[str, int] | None = None  # (host, port) of the TCP data port; None: off
    tls: ssl.SSLContext | None = None  # the TCP port's TLS (the gRPC port's certificate)
    handshake_s: float = 10.0  # a TCP session's TLS handshake and HELLO must end within this
    tcp_port: int = 0  # the TCP port bound, once started
    sessions: set[Session] = field(default_factory=set)
    senders: ThreadPoolExecutor | None = None  # GET_PART's sending threads (at most one a session)
    _listeners: list[socket.socket] = field(default_factory=list)
    _accepting: list[asyncio.Future] = field(default_factory=list)

    async def start(self) -> None:
        self.senders = ThreadPoolExecutor(self.max_sessions, thread_name_prefix="tierkv-send")
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # a socket left by a server that died
            self.path.parent.mkdir(parents=True, exist_ok=True)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)  # this user only; the token authenticates the session
            self._listen(sock, shm=True)
        if self.tcp is not None:
            host, port = self.tcp
            tcp = socket.create_server((host, port), family=_family(host), backlog=64)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.tcp_port = tcp.getsockname()[1]
            self._listen(tcp, shm=False)

    def _listen(self, sock: socket.socket, shm: bool) -> None:
        sock.listen(64)
        sock.setblocking(False)
        self._listeners.append(sock)
        self._accepting.append(asyncio.ensure_future(self._accept(sock, shm)))

    async def _accept(self, listener: socket.socket, shm: bool) -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task] = set()
        while True:
            sock, _ = await loop.sock_accept(listener)
            sock.setblocking(False)
            if not shm:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = asyncio.ensure_future(self._serve(sock, shm))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    async def stop(self) -> None:
        for a in self._accepting:
            a.cancel()
        if self.senders is not None:
            self.senders.shutdown(wait=False)
        for sock in self._listeners:
            sock.close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        for s in list(self.sessions):
            if s.region is not None:
                s.region.close()
        self.sessions.clear()

    async def _serve(self, sock: socket.socket, shm: bool) -> None:
        session, conn = None, Conn(sock)
        try:
            tls = None if shm else self.tls
            conn = await asyncio.wait_for(Conn.open(sock, tls, True), self.handshake_s)
            session = await asyncio.wait_for(self._hello(conn, shm), self.handshake_s)
            if session is None:
                return
            while True:
                op, count, body = await recv_request(conn)
                if op == RELEASE and session.region is not None:
                    if len(body) != 8 * count:
                        raise Refused("RELEASE body does not hold its offsets")
                    for (off,) in struct.iter_unpack("<Q", body):
                        try:
                            session.ranges.release(off)
                        except ValueError as e:
                            raise Refused(str(e)) from None
                elif op == GET and session.region is None:
                    await ops.get_inline(self.store, self.counts, conn, session, count, body)
                elif op == GET:
                    await conn.sendall(
                        await ops.get_into_region(self.store, self.counts, session, count, body)
                    )
                elif op == GET_PART:
                    await server_part.get_part(
                        self.store, self.counts, conn, session, count, body, self.senders
                    )
                elif op == STREAM:
                    await ops.stream(
                        self.store, self.counts, conn, session, count, body, self.inflight
                    )
                elif op == PUT and count == 1:
                    reply = await server_put.put(
                        self.store,
                        self.counts,
                        conn,
                        session,
                        body,
                        self.max_segment_bytes,
                        self.inflight,
                    )
                    await conn.sendall(reply)
                else:
                    raise Refused(f"unknown op {op} (count {count})")
        except (Refused, ValueError) as e:
            log.warning("data plane session refused: %s", e)
            with contextlib.suppress(OSError):
                await conn.sendall(pack(BAD_REQUEST, 0, str(e).encode()[:1024]))
        except Busy as e:
            with contextlib.suppress(OSError):
                await conn.sendall(pack(BUSY, 0, str(e).encode()[:1024]))
        except (ConnectionError, EOFError, OSError, ssl.SSLError, asyncio.TimeoutError):
            pass  # the client went away (perhaps killed: its region goes with it), or failed TLS
        finally:
            conn.close()
            if session is not None:
                self.sessions.discard(session)
                if session.region is not None and not session.region.close():
                    # An exchange that failed midway left views of the region in its
                    # traceback's reference cycle: collect it, so the region goes now.
                    gc.collect()
                    session.region.close()

    async def _hello(self, conn: Conn, shm: bool) -> Session | None:
        op, _, body = await recv_request(conn)
        if op != HELLO:
            raise Refused("the first message must be HELLO")
        ns = self.auth.of_token(body.decode(errors="replace"))
        if ns is None:
            await conn.sendall(pack(UNAUTHENTICATED, 0, b"missing or invalid bearer token"))
            return None
        if len(self.sessions) >= self.max_sessions:
            await conn.sendall(pack(BAD_REQUEST, 0, b"too many data plane sessions"))
            return None
        if not shm:
            session = Session(ns, None, RangeAllocator(ALIGN))
            self.sessions.add(session)
            await conn.sendall(pack(OK, 0, WELCOME.pack(0, VERSION)))
            return session
        region = Region.create(self.region_bytes)
        session = Session(ns, region, RangeAllocator(region.size))
        self.sessions.add(session)
        msg = pack(OK, 0, WELCOME.pack(region.size, VERSION))
        fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [region.fd]))]
        conn.sock.setblocking(True)  # one small message with the fd; then back to non-blocking
        try:
            conn.sock.sendmsg([msg], fds)
        finally:
            conn.sock.setblocking(False)
            region.close_fd()  # the client has its own; the mapping keeps the memory
        return session


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
