"""The server's GET_PART (protocol in cacheserver.dataplane.protocol): one share of a key's
layers on one connection of a striped load, sent from a worker thread.

A striped client reads its shares on several connections at once; this server serves every
session on one event loop, so the kernel's copy of each share onto its socket runs in a worker
thread (a blocking-style `sendmsg` loop releases the GIL while the kernel copies) and the
shares of two connections overlap.

Safety contract: the request is checked (one key, 0 <= part < parts <= MAX_PARTS, a TCP
session) before anything is read: a bad one raises Refused (BAD_REQUEST, the session closes,
nothing changes). A cpu-tier hit is sent from the tier's pages under their read lease, and the
lease is released only after the sending thread returned, whether the send ended, failed (the
client went away) or the task was cancelled (the socket is shut down first, so the thread ends
promptly). A send that makes no progress for SEND_STALL_S fails the session.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Sequence
from concurrent.futures import Executor

import torch

from tierkv.cacheserver.dataplane.conn import IOV_MAX, Conn
from tierkv.cacheserver.dataplane.protocol import (
    MAX_PARTS,
    OK,
    PART,
    REPLY,
    pack,
    part_layers,
)
from tierkv.cacheserver.dataplane.server_ops import Counts, Refused, Session
from tierkv.storage_backends.cpu_tier import CpuTier
from tierkv.storage_backends.names import KEY_NBYTES
from tierkv.storage_backends.store import TieredStore

SEND_STALL_S = 30.0  # a client that reads nothing for this long ends its session
POLL_S = 0.5


async def get_part(
    store: TieredStore,
    counts: Counts,
    conn: Conn,
    s: Session,
    count: int,
    body: bytes,
    senders: Executor | None,
) -> None:
    """Answer GET_PART; the share is sent on a thread of `senders` (its own pool: a stalled
    client holds one of them, never a thread of the loop's default executor)."""
    if count != 1 or len(body) != KEY_NBYTES + PART.size:
        raise Refused(f"GET_PART of {count} keys with a body of {len(body)} bytes")
    part, parts = PART.unpack_from(body, KEY_NBYTES)
    if not 0 <= part < parts <= MAX_PARTS:
        raise Refused(f"GET_PART of part {part} of {parts} (at most {MAX_PARTS} parts)")
    if s.region is not None:
        raise Refused("GET_PART is an op of the TCP port")
    key = body[:KEY_NBYTES]
    top = store.tiers[0]
    views = top.payload_views(key, s.ns) if isinstance(top, CpuTier) else None
    if views is not None:
        with views:  # held until the sending thread returned
            h = views.header
            first, end = part_layers(h.num_layers, part, parts)
            lo, hi = first * h.layer_raw_nbytes, end * h.layer_raw_nbytes
            head = h.encode()
            msg = pack(OK, 1) + REPLY.pack(lo, hi - lo, len(head)) + head
            await send_off_loop(conn, [memoryview(msg), *cut(views.views, lo, hi)], senders)
        counts.count_get(s.ns, top.name, hi - lo)
        return
    seg, where = await store.get_from(key, s.ns)
    if seg is None:
        counts.count_get(s.ns, "", 0)
        await conn.sendall(pack(OK, 1) + REPLY.pack(0, 0, 0))
        return
    h = seg.full_header()
    first, end = part_layers(h.num_layers, part, parts)
    lo, hi = first * h.layer_raw_nbytes, end * h.layer_raw_nbytes
    raw = seg.payload.reshape(-1).view(torch.uint8).numpy().data
    head = h.encode()
    msg = pack(OK, 1) + REPLY.pack(lo, hi - lo, len(head)) + head
    await send_off_loop(conn, [memoryview(msg), raw[lo:hi]], senders)
    counts.count_get(s.ns, where, hi - lo)


def cut(views: Sequence[memoryview], lo: int, hi: int) -> list[memoryview]:
    """Bytes [lo, hi) of the concatenation of views, as views of them (no copy)."""
    out, at = [], 0
    for v in views:
        a, b = max(lo - at, 0), min(hi - at, len(v))
        if a < b:
            out.append(v[a:b])
        at += len(v)
    return out


async def send_off_loop(conn: Conn, views: list[memoryview], senders: Executor | None) -> None:
    """Send views in order from a thread of senders (on the loop under TLS: its records are
    made here, or without senders); returns only once the thread no longer touches them."""
    if conn.tls is not None or senders is None:
        await conn.send_views(views)
        return
    await conn.on_thread(senders, send_blocking, conn.sock, views)


def send_blocking(sock: socket.socket, views: list[memoryview]) -> None:
    """Send every byte of views on the (non-blocking) socket, waiting for room in poll: the
    GIL is released in both. Raises when the peer went away or read nothing for SEND_STALL_S."""
    rest = [b for b in (v.cast("B") for v in views) if len(b)]
    waiting, poll = 0.0, select.poll()
    poll.register(sock.fileno(), select.POLLOUT)
    while rest:
        try:
            sent = sock.sendmsg(rest[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            if not poll.poll(POLL_S * 1000):
                waiting += POLL_S
                if waiting >= SEND_STALL_S:
                    raise TimeoutError("the client read nothing") from None
            continue
        waiting = 0.0
        while rest and sent >= len(rest[0]):
            sent -= len(rest.pop(0))
        if sent:
            rest[0] = rest[0][sent:]
