"""The server's same-host data plane: loads over shared memory, one session per Unix socket
connection (protocol and safety contract in cacheserver.shm).

A GET copies each segment's payload once, from the tier holding it into the session's
region (a cpu-tier hit is read straight into the region); its encoded header travels in the
reply. Sessions are bounded (`max_sessions`), each region is `shm_region_bytes`, and a
session's region is unmapped and closed when its socket closes.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierkv.cacheserver.auth import Auth
from tierkv.cacheserver.shm import (
    BAD_REQUEST,
    GET,
    HEAD,
    HELLO,
    MAX_BODY,
    MAX_KEYS,
    OK,
    RELEASE,
    REPLY,
    UNAUTHENTICATED,
    RangeAllocator,
    Region,
    pack,
    recv_exactly,
)
from tierkv.storage_backends.base import KEY_NBYTES, IndexedTier
from tierkv.storage_backends.store import TieredStore

log = logging.getLogger("tierkv.dataplane")


class Refused(Exception):
    """A malformed request: the session is closed."""


@dataclass(slots=True, eq=False)
class Session:
    ns: str
    region: Region
    ranges: RangeAllocator


@dataclass(slots=True, eq=False)
class DataPlane:
    store: TieredStore
    auth: Auth
    path: Path
    region_bytes: int
    max_sessions: int
    sessions: set[Session] = field(default_factory=set)
    _listener: socket.socket | None = None
    _accepting: asyncio.Future | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a socket left by a server that died
        self.path.parent.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.path))
        os.chmod(self.path, 0o600)  # this user only; the token authenticates the session
        sock.listen(64)
        sock.setblocking(False)
        self._listener = sock
        self._accepting = asyncio.ensure_future(self._accept(sock))

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task] = set()
        while True:
            conn, _ = await loop.sock_accept(listener)
            conn.setblocking(False)
            t = asyncio.ensure_future(self._serve(conn))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        if self._listener is not None:
            self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        for s in list(self.sessions):
            s.region.close()
        self.sessions.clear()

    async def _serve(self, conn: socket.socket) -> None:
        session = None
        try:
            session = await self._hello(conn)
            if session is None:
                return
            while True:
                op, count, body = await _recv(conn)
                if op == RELEASE:
                    if len(body) != 8 * count:
                        raise Refused("RELEASE body does not hold its offsets")
                    for (off,) in struct.iter_unpack("<Q", body):
                        try:
                            session.ranges.release(off)
                        except ValueError as e:
                            raise Refused(str(e)) from None
                elif op == GET:
                    await _sendall(conn, await self._get(session, count, body))
                else:
                    raise Refused(f"unknown op {op}")
        except (Refused, ValueError) as e:
            log.warning("data plane session refused: %s", e)
            with contextlib.suppress(OSError):
                await _sendall(conn, pack(BAD_REQUEST, 0, str(e).encode()[:1024]))
        except (ConnectionError, EOFError, OSError):
            pass  # the client went away, perhaps killed: its region goes with it
        finally:
            conn.close()
            if session is not None:
                self.sessions.discard(session)
                session.region.close()

    async def _hello(self, conn: socket.socket) -> Session | None:
        op, _, body = await _recv(conn)
        if op != HELLO:
            raise Refused("the first message must be HELLO")
        ns = self.auth.of_token(body.decode(errors="replace"))
        if ns is None:
            await _sendall(conn, pack(UNAUTHENTICATED, 0, b"missing or invalid bearer token"))
            return None
        if len(self.sessions) >= self.max_sessions:
            await _sendall(conn, pack(BAD_REQUEST, 0, b"too many data plane sessions"))
            return None
        region = Region.create(self.region_bytes)
        session = Session(ns, region, RangeAllocator(region.size))
        self.sessions.add(session)
        msg = pack(OK, 0, struct.pack("<Q", region.size))
        fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [region.fd]))]
        conn.setblocking(True)  # one small message with the fd; then back to non-blocking
        try:
            conn.sendmsg([msg], fds)
        finally:
            conn.setblocking(False)
            region.close_fd()  # the client has its own; the mapping keeps the memory
        return session

    async def _get(self, s: Session, count: int, body: bytes) -> bytes:
        if not 0 < count <= MAX_KEYS or len(body) != count * KEY_NBYTES:
            raise Refused(f"GET of {count} keys with a body of {len(body)} bytes")
        keys = [body[i * KEY_NBYTES : (i + 1) * KEY_NBYTES] for i in range(count)]
        out, heads = [], []
        for key in keys:
            off, n, head = await self._read(s, key)
            out.append(REPLY.pack(off, n, len(head)))
            heads.append(head)
        return pack(OK, count, b"".join(out) + b"".join(heads))

    async def _read(self, s: Session, key: bytes) -> tuple[int, int, bytes]:
        """(offset, payload bytes, encoded header) of key's segment copied into the region, or
        (0, 0, b"") on a miss or when the region is full (the client then loads over gRPC)."""
        top = self.store.tiers[0]
        entry = top.index.get((s.ns, key)) if isinstance(top, IndexedTier) else None
        head = getattr(entry, "header", None)
        if head is not None and head.codec == "none":  # read straight into the region
            n = head.payload_raw_nbytes
            off = s.ranges.alloc(n)
            if off is None:
                return 0, 0, b""
            seg = await self.store.get(key, s.ns, out=memoryview(s.region.map)[off : off + n])
            if seg is None:
                s.ranges.release(off)
                return 0, 0, b""
            return off, n, head.encode()
        # A slower tier, or a compressed segment: decoded here, then copied into the region.
        seg = await self.store.get(key, s.ns)
        if seg is None:
            return 0, 0, b""
        raw = seg.payload.reshape(-1).view(torch.uint8).numpy().data
        off = s.ranges.alloc(len(raw))
        if off is None:
            return 0, 0, b""
        s.region.map[off : off + len(raw)] = raw
        return off, len(raw), seg.header().encode()


async def _recv(conn: socket.socket) -> tuple[int, int, bytes]:
    op, count, n = HEAD.unpack(await recv_exactly(conn, HEAD.size))
    if n > MAX_BODY:
        raise Refused(f"request body of {n} bytes exceeds {MAX_BODY}")
    return op, count, await recv_exactly(conn, n) if n else b""


async def _sendall(conn: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(conn, data)
