"""Pipelined exchanges on one data plane connection: a request goes out as soon as the socket
is free to send, before the replies to earlier requests were read. The server reads and
answers a session's requests one at a time, in order, so replies come back in request order;
each exchange reads its own reply when every earlier one was read (its turn), then passes the
turn on.

Safety contract: a reply is read only by the exchange whose request it answers (turns follow
the order requests were sent, under one send lock); an exchange that fails or is cancelled
after its request's first byte went out and before its reply's last byte was read leaves the
framing unknown, so it breaks the pipeline: the socket is shut down, the exchanges sending or
reading wake with an error, and every exchange waiting or started afterwards raises
ConnectionError without touching the socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tierkv.cacheserver.dataplane.conn import Conn

Views = Sequence[bytes | memoryview]


@dataclass(slots=True, eq=False)
class Pipeline:
    """The exchanges in flight on one connection (safety contract in the module docstring)."""

    conn: Conn
    on_close: Callable[[], None]  # frees the connection once no exchange uses it
    sending: asyncio.Lock = field(default_factory=asyncio.Lock)
    last: asyncio.Event | None = None  # set once the latest request's reply was read
    broken: str = ""  # why the framing was lost; "" while it holds
    closing: bool = False
    freed: bool = False
    users: int = 0  # exchanges between their first await and their end
    in_flight: int = 0  # requests sent whose replies were not read whole yet
    max_in_flight: int = 0  # its high-water mark

    def close(self) -> None:
        """Break the pipeline; the connection is freed once the last exchange left."""
        self.closing = True
        self._break("session closed")
        self._free()

    def exchange(self, request: Callable[[], Views]) -> Exchange:
        """`async with pipe.exchange(request)`: send request() (built under the send lock, so
        it may take what earlier replies left to say, such as ranges to RELEASE), then wait
        for the turn; the block reads this request's reply, and nothing else."""
        return Exchange(self, request)

    def _check(self) -> None:
        if self.broken:
            raise ConnectionError(f"data plane session broken: {self.broken}")

    def _break(self, why: str) -> None:
        if not self.broken:
            self.broken = why
            self.conn.shutdown()

    def _free(self) -> None:
        if self.closing and not self.users and not self.freed:
            self.freed = True
            self.on_close()


@dataclass(slots=True, eq=False)
class Exchange:
    """One request and its reply's turn. A class, not a generator: it is on every get's path,
    and contextlib's wrapper costs as much again as the rest of it."""

    pipe: Pipeline
    request: Callable[[], Views]
    mine: asyncio.Event | None = None  # set when this reply was read: the next one's turn
    sent: bool = False

    async def __aenter__(self) -> None:
        p = self.pipe
        p._check()
        p.users += 1
        try:
            async with p.sending:
                p._check()
                prev, self.mine = p.last, asyncio.Event()
                p.last = self.mine
                await p.conn.send_views([memoryview(v) for v in self.request()])
            self.sent = True
            p.in_flight += 1
            p.max_in_flight = max(p.max_in_flight, p.in_flight)
            if prev is not None:
                await prev.wait()
            p._check()
        except BaseException as e:
            self._end(e)
            raise

    async def __aexit__(self, kind: object, e: BaseException | None, tb: object) -> None:
        self._end(e)

    def _end(self, e: BaseException | None) -> None:
        p = self.pipe
        if e is not None and self.mine is not None:  # some of the request went out
            p._break(f"exchange failed midway: {e!r}")
        if self.sent:
            p.in_flight -= 1
        if self.mine is not None:
            self.mine.set()  # the next in line reads its reply, or finds the pipeline broken
        p.users -= 1
        p._free()
