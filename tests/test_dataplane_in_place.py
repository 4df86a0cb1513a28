"""STREAMs read in place from a shared-memory region (a sink's `place`): the layers a sink reads
are the stored bytes, checked there before it sees them; the ranges are RELEASEd exactly once,
only after the sink's last `ready`, and never leak, also when a layer in the region is corrupt,
the session breaks midway or the sink raises. Against a scripted server over a real socket and
a real region, and against a real tierkv-server process."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.dataplane.client_session import Session
from tierkv.cacheserver.dataplane.conn import Conn
from tierkv.cacheserver.dataplane.protocol import FRAME, HEAD, OK, RELEASE
from tierkv.cacheserver.dataplane.region import RangeAllocator, Region
from tierkv.cacheserver.launch import ServerProcess
from tierkv.storage_backends.copies import counting
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.segment import KVSegment

from .test_shm import sessions

LAYERS = 4


def segment(i: int) -> KVSegment:
    kv = torch.randn(LAYERS, 2, 32, 2, 64, generator=torch.Generator().manual_seed(i))
    key = bytes([i % 256]) * 15 + bytes([i // 256])
    return KVSegment.from_tensor(
        kv.to(torch.bfloat16), key=key, tokens=list(range(32)), fingerprint=b"f" * 16
    )


def layer_bytes(seg: KVSegment, layer: int) -> bytes:
    return seg.payload[layer].contiguous().view(torch.uint8).numpy().tobytes()


class Boom(Exception):
    pass


class Placing:
    """A sink that reads every region layer in place (in `ready`, as a scatter would) and checks,
    while it reads, that the session has not released a range yet."""

    def __init__(self, session: Session | None = None, boom_at: int = -1) -> None:
        self.session, self.boom_at = session, boom_at
        self.views: dict[tuple[int, int], memoryview] = {}
        self.read: dict[tuple[int, int], bytes] = {}
        self.dropped: dict[int, str] = {}
        self.inline = 0
        self.readies: list[int] = []

    def open(self, i: int, h: SegmentHeader) -> bool:
        return True

    def into(self, i: int, layer: int) -> memoryview:  # layers that come inline
        self.inline += 1
        buf = memoryview(bytearray(32 * 2 * 64 * 2 * 2))
        self.views[(i, layer)] = buf
        return buf

    def place(self, i: int, layer: int, data: memoryview) -> None:
        assert data.readonly and (i, layer) not in self.views
        self.views[(i, layer)] = data

    def drop(self, i: int, why: str) -> None:
        assert i not in self.dropped
        self.dropped[i] = why

    async def ready(self, layer: int) -> None:
        self.readies.append(layer)
        if self.session is not None:
            assert self.session.released == []  # nothing given back while the sink reads
        if layer == self.boom_at:
            raise Boom
        for (i, at), v in self.views.items():
            if at == layer and i not in self.dropped:
                self.read[(i, at)] = bytes(v)


def scripted(segs: list[KVSegment], region: Region, alloc: RangeAllocator, bad: set) -> bytes:
    """A server's STREAM reply with every layer in the region: each key's range allocated, its
    layers written there and framed, layer-major; the layers in `bad` altered in the region
    after their checksum was taken."""
    base = [alloc.alloc(s.payload.nbytes) for s in segs]
    out = [HEAD.pack(OK, len(segs), 0)]
    for layer in range(LAYERS):
        for i, s in enumerate(segs):
            data = layer_bytes(s, layer)
            at = base[i] + layer * len(data)  # type: ignore[operator]
            region.map[at : at + len(data)] = data
            if (i, layer) in bad:
                region.map[at] ^= 0x5A
            head = s.full_header().encode() if layer == 0 else b""
            out.append(FRAME.pack(i, layer, len(head), len(data), at) + head)
    return b"".join(out)


def released(msg: bytes) -> list[int]:
    """The offsets a client's RELEASE message gives back."""
    op, count, n = HEAD.unpack_from(msg)
    assert op == RELEASE and n == 8 * count == len(msg) - HEAD.size
    return list(struct.unpack_from(f"<{count}Q", msg, HEAD.size))


@settings(max_examples=60, deadline=None)
@given(
    keys=st.integers(1, 3),
    bad=st.sets(st.tuples(st.integers(0, 2), st.integers(0, LAYERS - 1)), max_size=2),
    cut=st.one_of(st.none(), st.integers(1, 3 * LAYERS)),
    boom_at=st.sampled_from([-1, -1, 0, LAYERS - 1]),
)
def test_in_place_layers_are_checked_and_their_ranges_released_once_after_the_sink(
    keys: int, bad: set, cut: int | None, boom_at: int
) -> None:
    segs = [segment(10 + i) for i in range(keys)]
    server_region = Region.create(1 << 20)
    alloc = RangeAllocator(server_region.size)
    wire = scripted(segs, server_region, alloc, bad)
    if cut is not None:  # the session breaks after `cut` frames
        frame_at = [HEAD.size]
        for _ in range(keys * LAYERS):
            hlen = FRAME.unpack_from(wire, frame_at[-1])[2]
            frame_at.append(frame_at[-1] + FRAME.size + hlen)
        wire = wire[: frame_at[min(cut, keys * LAYERS)]]

    async def run() -> tuple[Placing, Session, bool]:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.sendall(wire)
        if cut is not None:
            theirs.shutdown(socket.SHUT_WR)
        s = Session(Conn(ours), Region.attach(os.dup(server_region.fd)), 1 << 20)
        sink = Placing(s, boom_at)
        failed = False
        try:
            await s.stream([g.key for g in segs], sink)
        except (Boom, EOFError, ValueError, OSError):
            failed = True
            with pytest.raises(ConnectionError):  # broken: no request (no RELEASE) goes out
                await s.stream([segs[0].key], Placing())
        finally:
            theirs.close()
        return sink, s, failed

    sink, s, failed = asyncio.run(run())
    try:
        for (i, layer), got in sink.read.items():  # never a byte that differs from the stored
            assert got == layer_bytes(segs[i], layer)
        for i, layer in bad:  # a corrupt layer is never handed to the sink
            assert (i, layer) not in sink.views
        complete = cut is None or cut >= keys * LAYERS
        assert failed == (not complete or boom_at in sink.readies)
        if not failed:
            assert sink.inline == 0
            for i in range(keys):
                corrupt = [layer for j, layer in bad if j == i]
                assert (i in sink.dropped) == bool(corrupt)
                if i not in sink.dropped:
                    assert all((i, layer) in sink.read for layer in range(LAYERS))
            # Given back once, every range, with the next request; then nothing more.
            offsets = released(s._releasing())
            assert sorted(offsets) == sorted(alloc.used) and s._releasing() == b""
            for off in offsets:
                alloc.release(off)
            assert not alloc.used
        else:
            assert s.broken
        alloc.check_integrity()
    finally:
        s.close()
        server_region.close()


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(args=["--shm-region-bytes", "1MiB"]).start()
    yield s
    s.stop(kill=True)


def test_a_real_server_streams_in_place_and_reuses_every_range(server) -> None:
    """24 keys of 128 KiB through a 1 MiB region, five times: the layers the sink reads in
    place equal the stored ones, none is copied out, and every stream finds the region's
    ranges free again (the last one's were released)."""

    async def run() -> None:
        t = DataTier(target=server.target)
        segs = [segment(200 + i) for i in range(24)]
        for g in segs:
            assert await t.put(g.key, g)
        for _ in range(5):
            assert t._session is not None
            sink = Placing(t._session)
            with counting() as c:
                await t.stream([g.key for g in segs], "default", sink)
            assert c["stream.copy_out"] == 0 and not sink.dropped
            assert len(sink.read) == 24 * LAYERS and 0 < sink.inline < 24 * LAYERS
            for (i, layer), got in sink.read.items():
                assert got == layer_bytes(segs[i], layer)
            assert t._session.released  # given back with the next request
        assert t.stats().errors == 0
        await t.close()

    asyncio.run(run())


def test_a_sink_that_raises_drops_its_session_and_the_next_one_works(server) -> None:
    """Each failed stream drops its session, whose region the server frees when the socket
    closes (a failure midway leaves views of it in a reference cycle that is collected then;
    at most the latest failure's region may still be held while it unwinds); a fresh session
    then streams in place as before."""

    async def run() -> None:
        before = sessions(server.proc.pid)
        t = DataTier(target=server.target)
        segs = [segment(300 + i) for i in range(24)]
        for g in segs:
            assert await t.put(g.key, g)
        for boom_at in (0, 1, LAYERS - 1):
            with pytest.raises(Boom):
                await t.stream([g.key for g in segs], "default", Placing(boom_at=boom_at))
            assert t._session is None  # dropped, with every range of its region
            t._down_until = 0.0  # retry the data plane at once
        deadline = time.monotonic() + 10
        while sessions(server.proc.pid) > before + 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert sessions(server.proc.pid) <= before + 1  # failed sessions' regions do not pile up
        sink = Placing()
        await t.stream([g.key for g in segs], "default", sink)
        assert t._session is not None and not sink.dropped
        assert len(sink.read) == 24 * LAYERS
        for (i, layer), got in sink.read.items():
            assert got == layer_bytes(segs[i], layer)
        await t.close()

    asyncio.run(run())
