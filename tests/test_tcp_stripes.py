"""Striped loads over the TCP data port (cacheserver.dataplane.stripes), against an in-process
server over its real TCP port: STREAMs split over several connections and gets of a key in
layer shares (GET_PART) return exactly the stored bytes (hypothesis), a stripe killed midway
drops the whole session and loads fall back to gRPC with the server's leases freed, and one
stripe is the plain connection. GET_PART on the wire: tests/test_tcp_parts.py."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.cacheserver.cli import build_store
from tierkv.cacheserver.config import ServerConfig
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.dataplane.conn import Conn
from tierkv.cacheserver.server import Server
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.cpu_tier import CpuTier
from tierkv.storage_backends.segment import KVSegment

MiB = 1 << 20


def segment(k: int, layers: int, tokens: int, version: int = 0) -> KVSegment:
    g = torch.Generator().manual_seed(k * 100 + version)
    kv = torch.randn(layers, 2, tokens, 2, 64, generator=g).to(torch.bfloat16)
    return KVSegment.from_tensor(kv, key=key(k), tokens=list(range(tokens)), fingerprint=b"f" * 16)


def key(k: int) -> bytes:
    return bytes([k + 1]) * 16


def raw(seg: KVSegment) -> bytes:
    return bytes(seg.payload.view(torch.uint8).numpy())


class Collect:
    """A LayerSink checking the contract: opened once, layers made ready in order, once, and
    nothing of layer l + 1 written before ready(l) returned."""

    def __init__(self, n: int, on_ready=None) -> None:
        self.bufs: list[bytearray] = [bytearray() for _ in range(n)]
        self.size = [0] * n
        self.dropped: dict[int, str] = {}
        self.readies: list[int] = []
        self.on_ready = on_ready

    def open(self, i: int, h) -> bool:
        assert not self.bufs[i], "opened twice"
        self.bufs[i], self.size[i] = bytearray(h.payload_raw_nbytes), h.layer_raw_nbytes
        return True

    def into(self, i: int, layer: int) -> memoryview:
        assert i not in self.dropped, "written after its drop"
        assert layer == len(self.readies), "a layer written before the last was made ready"
        n = self.size[i]
        return memoryview(self.bufs[i])[layer * n : (layer + 1) * n]

    def drop(self, i: int, why: str) -> None:
        assert i not in self.dropped, "dropped twice"
        self.dropped[i] = why

    async def ready(self, layer: int) -> None:
        assert layer == len(self.readies), "layers made ready out of order"
        self.readies.append(layer)
        if self.on_ready is not None:
            self.on_ready(layer)


async def in_process(cpu: str = "256MiB") -> tuple[Server, CpuTier]:
    import tempfile

    config = ServerConfig(
        port=0, cache_dir=tempfile.mkdtemp(), tiers=TiersConfig(cpu_bytes=cpu, disk_bytes=0)
    )
    server = await Server.start(config, build_store(config))
    top = server.store.tiers[0]
    assert isinstance(top, CpuTier)
    return server, top


async def leases_freed(cpu: CpuTier) -> None:
    """Every zero-copy reader of the tier ended (a killed session's send ends promptly)."""
    for _ in range(500):
        if not cpu.kept and all(e.readers == 0 for e in cpu.index.values()):
            break
        await asyncio.sleep(0.01)
    assert not cpu.kept and all(e.readers == 0 for e in cpu.index.values()), "a lease leaked"
    cpu.check_integrity()


@settings(max_examples=12, deadline=None)
@given(
    stripes=st.integers(1, 4),
    keys=st.integers(1, 9),
    layers=st.sampled_from([1, 2, 3, 8]),
    tokens=st.sampled_from([16, 100, 1024]),
)
def test_striped_streams_and_gets_return_the_stored_bytes(stripes, keys, layers, tokens) -> None:
    async def run() -> None:
        server, cpu = await in_process()
        t = DataTier(
            target=f"127.0.0.1:{server.port}",
            shared_memory=False,
            stripes=stripes,
            stripe_min_bytes=1,  # every get with an `out` is striped
        )
        try:
            segs = [segment(k, layers, tokens) for k in range(keys)]
            for s in segs:
                assert await t.put(s.key, s)
            names = [s.key for s in segs]
            names.insert(keys // 2, key(200))  # a miss amid the hits
            sink = Collect(len(names))
            await t.stream(names, "default", sink)
            assert sink.dropped == {keys // 2: "miss"}
            assert sink.readies == list(range(layers))
            got = [b for i, b in enumerate(sink.bufs) if i != keys // 2]
            assert got == [raw(s) for s in segs]
            outs = [torch.empty_like(s.payload) for s in segs]
            gets = await asyncio.gather(*(t.get(s.key, out=o) for s, o in zip(segs, outs)))
            for s, g in zip(segs, gets):
                assert g is not None and g.verified and torch.equal(g.payload, s.payload)
            assert await t.get(key(201), out=torch.empty_like(segs[0].payload)) is None
            assert t.session_open and t.stats().errors == 0
            s0 = t._session
            assert s0 is not None and s0.region is None and s0.version == 2
            extra = 0 if t._stripes is None else len(t._stripes.extra)
            assert extra == stripes - 1
            await leases_freed(cpu)
        finally:
            await t.close()
            await server.stop()

    asyncio.run(run())


def test_a_stripe_killed_midway_drops_the_session_and_frees_the_leases() -> None:
    async def run() -> None:
        server, cpu = await in_process()
        t = DataTier(target=f"127.0.0.1:{server.port}", shared_memory=False, stripes=3)
        try:
            segs = [segment(k, 8, 512) for k in range(7)]
            for s in segs:
                assert await t.put(s.key, s)

            def kill(layer: int) -> None:
                if layer == 2:
                    assert t._stripes is not None
                    t._stripes.extra[1].conn.sock.shutdown(socket.SHUT_RDWR)

            sink = Collect(len(segs), kill)
            await t.stream([s.key for s in segs], "default", sink)
            assert not t.session_open, "the session outlived a failed stripe"
            assert t._stripes is not None and t._stripes.extra == []
            # shares of keys [0, 2), [2, 4), [4, 7): the killed one's keys are dropped; a key
            # of another share is dropped or whole (layers it delivered before the failure)
            assert {4, 5, 6} <= set(sink.dropped) and "miss" not in sink.dropped.values()
            assert 3 <= len(sink.readies) < 8 or len(sink.dropped) < 7
            for i in set(range(7)) - set(sink.dropped):
                assert len(sink.readies) == 8 and sink.bufs[i] == raw(segs[i])
            await leases_freed(cpu)
            for s in segs:  # the session is down: gets go over gRPC, whole
                g = await t.get(s.key)
                assert g is not None and torch.equal(g.payload, s.payload)
        finally:
            await t.close()
            await server.stop()

    asyncio.run(run())


@settings(max_examples=8, deadline=None)
@given(delay_ms=st.integers(0, 30), which=st.integers(0, 1))
def test_a_stripe_killed_during_a_big_get_falls_back_whole(delay_ms, which) -> None:
    async def run() -> None:
        server, cpu = await in_process()
        t = DataTier(target=f"127.0.0.1:{server.port}", shared_memory=False, stripes=2)
        try:
            big = segment(1, 8, 4096)  # 16 MiB: striped (stripe_min_bytes is 8 MiB)
            assert await t.put(big.key, big)
            out = torch.empty_like(big.payload)
            first = await t.get(big.key, out=out)  # opens both stripes
            assert first is not None and torch.equal(first.payload, big.payload)
            assert t._stripes is not None and len(t._stripes.extra) == 1
            conns = [t._session.conn, t._stripes.extra[0].conn]  # type: ignore[union-attr]
            timer = threading.Timer(delay_ms / 1000, lambda: conns[which].shutdown())
            timer.start()
            out.zero_()
            got = await t.get(big.key, out=out)  # striped, or over gRPC once a stripe died
            timer.join()
            assert got is not None and torch.equal(got.payload, big.payload)
            await leases_freed(cpu)
        finally:
            await t.close()
            await server.stop()

    asyncio.run(run())


def test_one_stripe_is_the_plain_connection() -> None:
    async def run() -> None:
        server, _ = await in_process()
        t = DataTier(target=f"127.0.0.1:{server.port}", shared_memory=False)
        try:
            segs = [segment(k, 4, 2048) for k in range(3)]  # 4 MiB each
            for s in segs:
                assert await t.put(s.key, s)
            await t.stream([s.key for s in segs], "default", Collect(3))
            g = await t.get(segs[0].key, out=torch.empty_like(segs[0].payload))
            assert g is not None and torch.equal(g.payload, segs[0].payload)
            assert t._session is not None and type(t._session.conn) is Conn
            assert t._stripes is None and t._pool is None
        finally:
            await t.close()
            await server.stop()

    asyncio.run(run())
    for bad in (0, 65):
        with pytest.raises(ValueError, match="stripes"):
            DataTier(target="127.0.0.1:1", stripes=bad)
