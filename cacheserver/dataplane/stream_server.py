"""The server's side of the data plane's STREAM op (protocol in cacheserver.dataplane.protocol):
`Outbound`, the sink that turns the store's layer-major stream into frames.

Safety contract: memory comes only from the in-flight budget (a layer buffer per inline key) or
the session's region, and goes back when the stream ends; a range the client never learnt of is
released at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.cacheserver.dataplane.conn import Conn
from tierkv.cacheserver.dataplane.protocol import FRAME, INLINE, buffer
from tierkv.cacheserver.dataplane.region import RangeAllocator, Region
from tierkv.cacheserver.frames import BadRequest
from tierkv.cacheserver.receive import Inflight
from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.header import SegmentHeader


@dataclass(slots=True, eq=False)
class Outbound:
    """The server's sink for one STREAM: each key's layers go into its range of the region, or
    (over TCP, or when the region is full) into a layer buffer sent after its frame."""

    conn: Conn
    region: Region | None
    ranges: RangeAllocator
    inflight: Inflight
    checks: bool = True  # the client checks every layer it receives (Inbound)
    heads: dict[int, SegmentHeader] = field(default_factory=dict)
    base: dict[int, int] = field(default_factory=dict)  # key -> its range in the region
    bufs: dict[int, memoryview] = field(default_factory=dict)  # key -> its inline layer buffer
    placed: list[int] = field(default_factory=list)  # keys written for the layer in progress
    sent: set[int] = field(default_factory=set)  # keys whose first frame went out
    pending: list[bytes] = field(default_factory=list)  # frames of dropped keys, not sent yet
    taken: int = 0
    done: list[tuple[int, int]] = field(default_factory=list)  # (key, payload bytes) served whole

    def open(self, i: int, header: SegmentHeader) -> bool:
        off = self.ranges.alloc(header.payload_raw_nbytes) if self.region is not None else None
        if off is not None:
            self.base[i] = off
        else:
            try:
                self.inflight.take(header.layer_raw_nbytes)
            except BadRequest:
                return False  # the budget is spent: this key is dropped, the client recomputes
            self.taken += header.layer_raw_nbytes
            self.bufs[i] = buffer(header.layer_raw_nbytes)
        self.heads[i] = header
        return True

    def into(self, i: int, layer: int) -> memoryview:
        self.placed.append(i)
        n = self.heads[i].layer_raw_nbytes
        if i in self.base:
            assert self.region is not None
            at = self.base[i] + layer * n
            copied("stream.copy_in", n)
            return memoryview(self.region.map)[at : at + n]
        return self.bufs[i]

    def drop(self, i: int, why: str) -> None:
        if i in self.placed:
            self.placed.remove(i)
        if i in self.base and i not in self.sent:  # the client never learnt of this range
            self.ranges.release(self.base.pop(i))
        msg = why.encode()[:1024]
        self.pending.append(FRAME.pack(i, 0, len(msg), 0, 0) + msg)

    async def ready(self, layer: int) -> None:
        out: list[bytes | memoryview] = list(self.pending)
        self.pending = []
        for i in self.placed:
            h = self.heads[i]
            head = h.encode() if i not in self.sent else b""
            self.sent.add(i)
            n = h.layer_raw_nbytes
            if i in self.base:
                out.append(FRAME.pack(i, layer, len(head), n, self.base[i] + layer * n) + head)
            else:
                out += [FRAME.pack(i, layer, len(head), n, INLINE) + head, self.bufs[i]]
            if layer + 1 == h.num_layers:
                self.done.append((i, h.payload_raw_nbytes))
        self.placed = []
        await self._send(out)

    async def finish(self) -> None:
        """Send the frames of keys dropped after the last layer went out."""
        out: list[bytes | memoryview] = list(self.pending)
        self.pending = []
        await self._send(out)

    async def _send(self, parts: list[bytes | memoryview]) -> None:
        """A layer's frames, and each inline layer from its own buffer, in one scatter-gather
        send (a few sendmsg calls for the whole layer, not two per key)."""
        if parts:
            await self.conn.send_views([memoryview(p) for p in parts])

    def close(self) -> None:
        self.inflight.give(self.taken)
        self.taken = 0
