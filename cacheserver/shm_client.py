"""ShmTier: RemoteTier whose loads move over the server's same-host data plane (shared
memory, see cacheserver.shm) while lookups, puts and deletes stay on gRPC.

Safety contract: RemoteTier's, and: the session authenticates with this tier's token; a
payload is copied out of the region and its layer checksums checked before the range is
released or the segment handed out; when the data plane is off, unreachable or fails, loads
go over gRPC (the session is dropped and retried after `retry_s`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.cacheserver.batch import Batcher
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.shm import (
    GET,
    HEAD,
    HELLO,
    MAX_KEYS,
    OK,
    RELEASE,
    REPLY,
    Region,
    pack,
    recv_exactly,
)
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.buffers import copy_bytes, out_view
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.segment import KVSegment, SegmentError

log = logging.getLogger("tierkv.remote")


@dataclass(slots=True, eq=False)
class _Want:
    key: bytes
    out: Any


@dataclass(slots=True, eq=False)
class _Session:
    sock: socket.socket
    region: Region
    released: list[int] = field(default_factory=list)  # offsets to release with the next GET

    def close(self) -> None:
        self.sock.close()
        self.region.close()


@dataclass(slots=True, eq=False)
class ShmTier(RemoteTier):
    retry_s: float = 5.0  # after a data plane failure, loads use gRPC this long
    name: str = "remote"
    _session: _Session | None = None
    _down_until: float = 0.0
    _opening: asyncio.Lock = field(default_factory=asyncio.Lock)
    _batch: Batcher[_Want, tuple[KVSegment, int] | None] | None = None  # reads -> one GET

    def __post_init__(self) -> None:
        self._start_stats(device="shm")

    async def _open(self) -> _Session | None:
        r = await self._retry(
            "data plane", lambda: self.stub.DataPlane(pb.DataPlaneRequest(), **self._opts())
        )
        if r is None or not r.unix_socket:
            return None
        loop = asyncio.get_running_loop()
        sock, fd = await loop.run_in_executor(None, self._handshake, r.unix_socket)
        sock.setblocking(False)
        return _Session(sock, Region.attach(fd))

    def _handshake(self, path: str) -> tuple[socket.socket, int]:
        """Connect, authenticate, receive the region's fd (blocking: run in a thread)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout_s)
            sock.connect(path)
            sock.sendall(pack(HELLO, 0, (self.token or "").encode()))
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

    async def _read(self, ns: str, key: bytes, out: Any) -> tuple[KVSegment, int] | None:
        if time.monotonic() >= self._down_until:
            try:
                got = await asyncio.wait_for(self._shm_read(key, out), self.timeout_s)
                if got is not None:
                    return got
            except (OSError, EOFError, ValueError, SegmentError, asyncio.TimeoutError) as e:
                self._drop(e)
        return await RemoteTier._read(self, ns, key, out)  # off, missed or failed: gRPC

    def _drop(self, e: BaseException) -> None:
        self._fail("shm get", e)
        self._down_until = time.monotonic() + self.retry_s
        if self._session is not None:
            self._session.close()
            self._session = None

    async def _shm_read(self, key: bytes, out: Any) -> tuple[KVSegment, int] | None:
        """Queue key for the next GET; concurrent reads (a request's chunks) share one
        message and one reply."""
        if self._session is None:
            async with self._opening:  # the first reads arrive together: one session
                if self._session is None:
                    self._session = await self._open()
            if self._session is None:
                self._down_until = time.monotonic() + self.retry_s
                return None
        if self._batch is None:
            self._batch = Batcher(self._exchange, MAX_KEYS)
        return await self._batch.submit(_Want(key, out))

    async def _exchange(self, batch: list[_Want]) -> list[tuple[KVSegment, int] | None | Exception]:
        s = self._session
        if s is None:
            raise ConnectionError("data plane session closed")
        loop = asyncio.get_running_loop()
        msg = pack(GET, len(batch), b"".join(w.key for w in batch))
        if s.released:
            rel = struct.pack(f"<{len(s.released)}Q", *s.released)
            msg = pack(RELEASE, len(s.released), rel) + msg
            s.released.clear()
        await loop.sock_sendall(s.sock, msg)
        code, count, n = HEAD.unpack(await recv_exactly(s.sock, HEAD.size))
        body = memoryview(await recv_exactly(s.sock, n))
        if code != OK or count != len(batch) or n < count * REPLY.size:
            raise ValueError(f"data plane answered {code}: {bytes(body[:200])!r}")
        out: list[tuple[KVSegment, int] | None | Exception] = []
        pos = count * REPLY.size
        for i, w in enumerate(batch):
            off, size, hlen = REPLY.unpack_from(body, i * REPLY.size)
            head, pos = body[pos : pos + hlen], pos + hlen
            if size == 0:
                out.append(None)
                continue
            try:
                out.append(self._take(s, w, off, size, head))
            except (ValueError, SegmentError) as e:
                out.append(e)
            finally:
                s.released.append(off)
        return out

    @staticmethod
    def _take(
        s: _Session, w: _Want, off: int, size: int, head: memoryview
    ) -> tuple[KVSegment, int] | None:
        """The one copy in this process: the payload out of the region, then checked."""
        h = SegmentHeader.decode(head)
        if h.key != w.key or h.payload_raw_nbytes != size or off + size > s.region.size:
            raise ValueError("data plane answered a range that does not fit the segment")
        into = (
            torch.empty(size, dtype=torch.uint8).numpy().data
            if w.out is None
            else out_view(w.out, size)
        )
        if into is None:  # a device tensor: RemoteTier's path copies into it
            return None
        copy_bytes(into, memoryview(s.region.map)[off : off + size])
        seg = KVSegment.from_raw(h, into, verify=True)
        return seg, seg.nbytes

    async def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
        await RemoteTier.close(self)
