"""The client's side of the data plane's STREAM op (protocol in cacheserver.dataplane.protocol):
`Inbound` checks each frame and writes its layer into the caller's sink.

Safety contract: every frame is checked against what was asked (index, layer order, header key
and shape, the region range) before a byte is used, and every layer's checksum before the sink
sees it ready. A frame that does not fit raises (the caller drops the session); a layer whose
checksum fails drops its key.

A sink with a `place(i, layer, data)` method reads the layers that lie in the region in place:
`data` is a read-only view of the layer's range, handed over only once its checksum was checked
there (the server writes a range only before its frame and never again before the client
RELEASEs it, so the checked bytes stay as they were). The ranges are RELEASEd only after the
stream returned, so after the sink's last `ready`; the sink must read every view by then and
keep none. Layers that come inline still go through `into`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tierkv.cacheserver.dataplane.conn import Conn
from tierkv.cacheserver.dataplane.protocol import INLINE, MAX_BODY, buffer
from tierkv.cacheserver.dataplane.region import Region
from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.segment import checksum
from tierkv.storage_backends.stream import LayerSink


@dataclass(slots=True, eq=False)
class Inbound:
    """The client's side of one STREAM: frames checked and written into `sink`. A key the sink
    no longer wants (refused, or a layer that failed its checksum) is still read to its end."""

    keys: Sequence[bytes]
    sink: LayerSink
    region: Region | None
    max_bytes: int  # largest payload accepted per key
    heads: list[SegmentHeader | None] = field(default_factory=list)
    nxt: list[int] = field(default_factory=list)  # next layer due from the server; -1: ended
    wanted: list[bool] = field(default_factory=list)  # the sink still takes this key
    base: list[int] = field(default_factory=list)  # region offset of each key's range, or -1
    ended: int = 0  # keys the server has finished with
    delivered: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))
    gone_at: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))
    gone: int = 0  # keys dropped at or before the layer made ready next
    next_ready: int = 0
    layers: int = 0  # the stream's layer count (its first header's)
    released: list[int] = field(default_factory=list)  # ranges to give back with the next op
    hits: int = 0
    nbytes: int = 0
    place: Callable[[int, int, memoryview], None] | None = None  # the sink's, if it reads in place

    def __post_init__(self) -> None:
        n = len(self.keys)
        self.heads, self.nxt, self.wanted, self.base = [None] * n, [0] * n, [True] * n, [-1] * n
        self.place = getattr(self.sink, "place", None)

    @property
    def finished(self) -> bool:
        return self.ended == len(self.keys)

    def fail(self, why: str) -> None:
        """The session failed: every key still wanted and not made ready whole is dropped (one
        whose last layer arrived, while a layer of another key did not, included)."""
        whole = self.layers and self.next_ready == self.layers
        for i in range(len(self.keys)):
            if self.wanted[i] and (self.nxt[i] >= 0 or not whole):
                self._gone(i, why, self.nxt[i] if self.nxt[i] >= 0 else self.next_ready)

    async def frame(self, conn: Conn, i: int, layer: int, hlen: int, size: int, off: int):
        if not 0 <= i < len(self.keys) or self.nxt[i] < 0:
            raise ValueError(f"stream frame for key {i}, which is not open")
        if size == 0:  # dropped by the server
            why = await conn.recv_exactly(min(hlen, MAX_BODY)) if hlen else b""
            if self.wanted[i]:
                self._gone(i, why.decode(errors="replace") or "dropped", self.nxt[i])
            self._end(i)
        else:
            if layer != self.nxt[i]:
                raise ValueError(f"stream frame of layer {layer} for key {i}, due {self.nxt[i]}")
            h = await self._head(conn, i, hlen, off) if layer == 0 else self.heads[i]
            if h is None or (hlen and layer) or size != h.layer_raw_nbytes:
                raise ValueError(f"stream frame of key {i} does not fit its header")
            await self._layer(conn, i, h, layer, size, off)
        await self._advance()

    async def _head(self, conn: Conn, i: int, hlen: int, off: int) -> SegmentHeader:
        if not 0 < hlen <= MAX_BODY:
            raise ValueError(f"stream header of {hlen} bytes")
        h = SegmentHeader.decode(await conn.recv_exactly(hlen))
        if h.key != self.keys[i] or h.payload_raw_nbytes > self.max_bytes:
            raise ValueError("stream answered a segment that does not fit the key asked")
        if off != INLINE:
            if self.region is None or off + h.payload_raw_nbytes > self.region.size:
                raise ValueError("stream range outside the region")
            self.base[i] = off
            self.released.append(off)
        self.heads[i] = h
        self.layers = self.layers or h.num_layers
        if h.num_layers != self.layers:
            self._gone(i, "its layer count differs from the stream's", 0)
        elif not self.sink.open(i, h):
            self._gone(i, "refused", 0)
        return h

    async def _layer(
        self, conn: Conn, i: int, h: SegmentHeader, layer: int, size: int, off: int
    ) -> None:
        in_place = False
        if off == INLINE:
            dst = self.sink.into(i, layer) if self.wanted[i] else buffer(size)
            await conn.recv_into(dst)
        else:
            if self.region is None or off != self.base[i] + layer * size:
                raise ValueError(f"stream range of key {i} layer {layer} is not its own")
            dst = memoryview(self.region.map)[off : off + size].toreadonly()
            in_place = self.place is not None or not self.wanted[i]  # nothing to copy out
            if not in_place:
                into = self.sink.into(i, layer)
                into[:] = dst
                dst = into
                copied("stream.copy_out", size)
        self.nxt[i] += 1
        if self.wanted[i]:
            if checksum(dst) != h.checksums[layer]:
                self._gone(i, f"miss: corrupt: layer {layer}: checksum mismatch", layer)
            else:
                if in_place and self.place is not None:
                    self.place(i, layer, dst)  # checked above, on these very bytes
                self.delivered[layer] += 1
                self.nbytes += size
                self.hits += self.nxt[i] == h.num_layers
        if self.nxt[i] == h.num_layers:
            self._end(i)

    def _end(self, i: int) -> None:
        self.nxt[i] = -1
        self.ended += 1

    def _gone(self, i: int, why: str, at: int) -> None:
        """The sink drops key i, which delivered layers [0, at)."""
        self.wanted[i] = False
        self.sink.drop(i, why)
        self.gone_at[at] += 1

    async def _advance(self) -> None:
        """Make ready every layer that each key has delivered or was dropped before."""
        n = len(self.keys)
        while self.layers and self.next_ready < self.layers:
            self.gone += self.gone_at.pop(self.next_ready, 0)
            if self.delivered[self.next_ready] + self.gone < n:
                return
            if self.delivered[self.next_ready]:
                await self.sink.ready(self.next_ready)
            self.next_ready += 1
