"""One data plane connection, on either side: a non-blocking socket, TLS-wrapped on the TCP port
when the server has TLS (an `ssl.SSLObject` over memory BIOs: asyncio's sock_* calls take no SSL
socket).

One task may send while another receives (a client's pipelined requests and replies): the
encrypted bytes of both leave through one flush at a time, so TLS records never interleave.

Safety contract: `recv_exactly` and `recv_into` return only once every byte asked for arrived
(EOFError when the peer closes first, or after `shutdown`); with TLS nothing leaves or enters
the process unencrypted, and a failed handshake raises before any data plane byte is
exchanged."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import ssl
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TypeVar, cast

T = TypeVar("T")
READ = 256 * 1024  # encrypted bytes taken from the socket per read
IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)


@dataclass(slots=True, eq=False)
class Conn:
    sock: socket.socket  # non-blocking
    tls: ssl.SSLObject | None = None
    incoming: ssl.MemoryBIO = field(default_factory=ssl.MemoryBIO)
    outgoing: ssl.MemoryBIO = field(default_factory=ssl.MemoryBIO)
    flushing: asyncio.Lock = field(default_factory=asyncio.Lock)  # one sock_sendall at a time

    @classmethod
    async def open(
        cls,
        sock: socket.socket,
        ctx: ssl.SSLContext | None,
        server_side: bool,
        host: str | None = None,
    ) -> Conn:
        """sock as a connection (of this class), TLS when ctx is given (the handshake done here)."""
        sock.setblocking(False)
        c = cls(sock)
        if ctx is not None:
            c.tls = ctx.wrap_bio(c.incoming, c.outgoing, server_side, host)
            await c._step(c.tls.do_handshake)
        return c

    def close(self) -> None:
        self.sock.close()

    def shutdown(self) -> None:
        """End both directions, the fd kept open: a task waiting to receive or send wakes (EOF,
        a broken pipe) instead of waiting on an fd that `close` would take from the loop."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    async def on_thread(self, pool: Executor, fn: Callable[..., None], *args: object) -> None:
        """fn(*args) on a thread of pool, a blocking send or receive on this socket. Cancelled,
        it shuts the socket down (the thread's next call fails at once) and returns only once
        the thread no longer touches the caller's buffers."""
        fut = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.shutdown()
            while not fut.done():
                try:
                    await asyncio.wait([fut])
                except asyncio.CancelledError:
                    continue
            raise

    async def _flush(self) -> None:
        if not self.outgoing.pending:  # a reader's step rarely has anything to send
            return
        async with self.flushing:  # what the BIO holds goes out in order, whoever flushes
            data = self.outgoing.read()
            if data:
                await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def _fill(self) -> None:
        data = await asyncio.get_running_loop().sock_recv(self.sock, READ)
        if not data:
            raise EOFError("connection closed")
        self.incoming.write(data)

    async def _step(self, op: Callable[[], T]) -> T:
        """Run one TLS operation, feeding the socket's bytes in and out until it completes."""
        while True:
            try:
                out = op()
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
                continue
            await self._flush()
            return out

    async def recv_exactly(self, n: int) -> bytes:
        if self.tls is None:
            return await _sock_recv_exactly(self.sock, n)
        buf = bytearray(n)
        await self.recv_into(memoryview(buf))
        return bytes(buf)

    async def recv_into(self, view: memoryview) -> None:
        if self.tls is None:
            return await _sock_recv_into(self.sock, view)
        tls, got = self.tls, 0
        while got < len(view):
            rest = view[got:]
            try:
                # read(n, buffer) returns a count (typeshed says bytes)
                k = cast(int, await self._step(functools.partial(tls.read, len(rest), rest)))
            except ssl.SSLZeroReturnError:
                k = 0
            if k == 0:
                raise EOFError("connection closed")
            got += k

    async def sendall(self, data: bytes | memoryview) -> None:
        if self.tls is None:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)
            return
        tls, view, sent = self.tls, memoryview(data).cast("B"), 0
        while sent < len(view):
            sent += tls.write(view[sent : sent + READ])
            await self._flush()

    async def send_views(self, views: list[memoryview]) -> None:
        """Send the buffers in order without joining them: scatter-gather sendmsg calls on a
        plain socket (the kernel's copy only), one buffer after another under TLS."""
        if self.tls is not None or len(views) == 1:
            for v in views:
                await self.sendall(v)
            return
        loop = asyncio.get_running_loop()
        rest = [b for b in (memoryview(v).cast("B") for v in views) if len(b)]
        while rest:
            try:
                sent = self.sock.sendmsg(rest[:IOV_MAX])
            except (BlockingIOError, InterruptedError):  # full: wait for room, send one whole
                await loop.sock_sendall(self.sock, rest.pop(0))
                continue
            while rest and sent >= len(rest[0]):
                sent -= len(rest.pop(0))
            if sent:
                rest[0] = rest[0][sent:]


def tls_context(ca: str | bytes) -> ssl.SSLContext:
    """A client context trusting the CA (PEM path or bytes) that signed the server's certificate,
    as the gRPC channel does."""
    pem = ca if isinstance(ca, bytes) else open(ca, "rb").read()
    return ssl.create_default_context(cadata=pem.decode())


async def _sock_recv_exactly(sock: socket.socket, n: int) -> bytes:
    """n bytes from a non-blocking socket; EOFError when it closes first."""
    try:  # most messages are already there: no future, no loop round
        first = sock.recv(n)
    except (BlockingIOError, InterruptedError):
        first = b""
    else:
        if not first and n:
            raise EOFError("connection closed")
        if len(first) == n:
            return first
    buf = bytearray(n)
    buf[: len(first)] = first
    view, got = memoryview(buf), len(first)
    loop = asyncio.get_running_loop()
    while got < n:  # nothing more is there yet: wait for it rather than try again at once
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)


async def _sock_recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill view from a non-blocking socket (the kernel's copy only); EOFError when it closes
    first."""
    loop, got, n = asyncio.get_running_loop(), 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
