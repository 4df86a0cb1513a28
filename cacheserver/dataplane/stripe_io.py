"""The receiving side of a striped load (cacheserver.dataplane.stripes): a connection whose
large receives run in a worker thread, and the client's GET_PART exchange.

One event loop receives every connection of a session in turn; a thread per stripe blocked in
`recv_into` (the GIL released while the kernel copies) lets the copies of several connections
run at once. Small receives (frame heads, headers, layers under THREAD_MIN) stay on the loop,
where a hand-off to a thread costs more than the copy.

Safety contract: `StripeConn.recv_into` fills its view whole or raises, as `Conn.recv_into`,
and returns only once its thread no longer writes into the view (a cancelled receive shuts the
socket down first, so the thread ends at once). `get_part` checks the reply against what it
asked (key, the range part_layers gives for the header's layers, sizes within the caller's
buffer) before a byte of payload is received, and each layer's checksum after; it reports
the layers that failed, and the caller hands out nothing of a payload with such a layer.
"""

from __future__ import annotations

import select
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tierkv.cacheserver.dataplane.client_session import Session
from tierkv.cacheserver.dataplane.conn import Conn
from tierkv.cacheserver.dataplane.protocol import (
    GET_PART,
    HEAD,
    MAX_BODY,
    OK,
    PART,
    REPLY,
    pack,
    part_layers,
)
from tierkv.storage_backends.header import SegmentHeader, checksum

THREAD_MIN = 256 * 1024  # smallest receive handed to a worker thread
POLL_S = 0.5


@dataclass(slots=True, eq=False)
class StripeConn(Conn):
    pool: ThreadPoolExecutor | None = None  # None: every receive on the loop

    async def recv_into(self, view: memoryview) -> None:
        if self.tls is not None or self.pool is None or len(view) < THREAD_MIN:
            return await Conn.recv_into(self, view)
        await self.on_thread(self.pool, recv_blocking, self.sock, view)


def recv_blocking(sock: socket.socket, view: memoryview) -> None:
    """Fill view from the (non-blocking) socket, waiting in poll: the GIL is released in both.
    EOFError when the peer closes or the socket is shut down first."""
    got, n, poll = 0, len(view), select.poll()
    poll.register(sock.fileno(), select.POLLIN)
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            poll.poll(POLL_S * 1000)
            continue
        if k == 0:
            raise EOFError("connection closed")
        got += k


@dataclass(slots=True)
class Part:
    header: SegmentHeader | None  # None: a miss
    bad: list[int]  # layers of this part whose checksum differs from the header's


async def get_part(s: Session, key: bytes, part: int, parts: int, buf: memoryview) -> Part:
    """Part `part` of `parts` of key's payload, received into its place in buf (the whole
    payload's bytes) and checked layer by layer."""
    msg = pack(GET_PART, 1, key + PART.pack(part, parts))
    async with s.pipe.exchange(lambda: [s._releasing() + msg]):
        code, count, n = HEAD.unpack(await s.conn.recv_exactly(HEAD.size))
        if code != OK or count != 1 or n:
            why = await s.conn.recv_exactly(min(n, MAX_BODY)) if n else b""
            raise ValueError(f"data plane answered {code} to a part: {why[:200]!r}")
        lo, size, hlen = REPLY.unpack(await s.conn.recv_exactly(REPLY.size))
        if hlen == 0:
            if lo or size:
                raise ValueError("data plane answered a part without its header")
            return Part(None, [])
        if hlen > MAX_BODY:
            raise ValueError(f"data plane announced a header of {hlen} bytes")
        h = SegmentHeader.decode(await s.conn.recv_exactly(hlen))
        first, end = part_layers(h.num_layers, part, parts)
        ln = h.layer_raw_nbytes
        if (
            h.key != key
            or h.payload_raw_nbytes > min(len(buf), s.max_bytes)
            or (lo, size) != (first * ln, (end - first) * ln)
        ):
            raise ValueError("data plane answered a part that does not fit the segment")
        bad = []
        for layer in range(first, end):  # each checked as soon as it arrived
            at = buf[layer * ln : (layer + 1) * ln]
            await s.conn.recv_into(at)
            if checksum(at) != h.checksums[layer]:
                bad.append(layer)
        return Part(h, bad)
