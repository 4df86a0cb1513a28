"""Layer-major streams of several keys (Tier.stream): from the cpu, disk and Redis tiers, a
tiered store spanning them, and a real tierkv-server over shared memory, TCP and gRPC. Every
layer arrives checked and equal to the stored one, in layer order, each layer made ready once
all keys delivered it; missing and broken keys are dropped, never delivered."""

from __future__ import annotations

import asyncio
import socket
import tempfile
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.dataplane.client_session import Session
from tierkv.cacheserver.dataplane.conn import Conn
from tierkv.cacheserver.dataplane.protocol import FRAME, HEAD, INLINE, OK
from tierkv.cacheserver.launch import ServerProcess
from tierkv.storage_backends.copies import counting
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.disk_tier import DiskTier, DiskTierConfig
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.redis_tier import RedisTier, RedisTierConfig
from tierkv.storage_backends.segment import KVSegment, SegmentError
from tierkv.storage_backends.store import StoreConfig, TieredStore

LAYERS = 4


def segment(i: int, codec: str = "none") -> KVSegment:
    g = torch.Generator().manual_seed(i)
    kv = torch.randn(LAYERS, 2, 32, 2, 64, generator=g).to(torch.bfloat16)
    key = bytes([i % 256]) * 15 + bytes([i // 256])
    return KVSegment.from_tensor(
        kv, key=key, tokens=list(range(32)), fingerprint=b"f" * 16, codec=codec
    )


@dataclass
class Sink:
    """Records the stream's calls and checks the contract as they come."""

    n: int
    bufs: dict[int, torch.Tensor] = field(default_factory=dict)
    heads: dict[int, SegmentHeader] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    dropped_after: dict[int, int] = field(default_factory=dict)
    written: dict[int, int] = field(default_factory=dict)  # key -> layers written
    ready_at: list[tuple[int, dict[int, int]]] = field(default_factory=list)
    on_ready: object = None

    def open(self, i: int, h: SegmentHeader) -> bool:
        assert i not in self.heads and i not in self.dropped
        self.heads[i] = h
        self.bufs[i] = torch.zeros(h.payload_raw_nbytes, dtype=torch.uint8)
        return True

    def into(self, i: int, layer: int) -> memoryview:
        assert i in self.heads and i not in self.dropped
        assert self.written.get(i, 0) == layer  # layers in order
        assert all(layer <= r + 1 for r, _ in self.ready_at[-1:])  # nothing past the next layer
        self.written[i] = layer + 1
        n = self.heads[i].layer_raw_nbytes
        return self.bufs[i].numpy().data[layer * n : (layer + 1) * n]

    def drop(self, i: int, why: str) -> None:
        assert i not in self.dropped
        self.dropped[i] = why
        self.dropped_after[i] = len(self.ready_at)  # layers made ready before the drop

    async def ready(self, layer: int) -> None:
        assert [r for r, _ in self.ready_at] == list(range(layer))
        for i in self.heads:  # every live key has delivered this layer
            assert i in self.dropped or self.written[i] > layer
        self.ready_at.append((layer, dict(self.written)))
        if callable(self.on_ready):
            await self.on_ready(layer)

    def payload(self, i: int) -> torch.Tensor:
        h = self.heads[i]
        return self.bufs[i].view(torch.bfloat16).view(h.num_layers, *h.layer_shape)


async def check_stream(tier, segs: list[KVSegment], missing: int = 2) -> Sink:
    keys = [s.key for s in segs] + [bytes([250, i]) * 8 for i in range(missing)]
    sink = Sink(len(keys))
    await tier.stream(keys, "default", sink)
    assert [r for r, _ in sink.ready_at] == list(range(LAYERS))
    for j, s in enumerate(segs):
        assert j not in sink.dropped, sink.dropped[j]
        assert torch.equal(sink.payload(j), s.payload)
    assert sorted(sink.dropped) == list(range(len(segs), len(keys)))
    return sink


@pytest.mark.parametrize("codec", ["none", "lz4"])
async def test_cpu_disk_and_redis_tiers_stream_layer_major(redis_proc, codec: str) -> None:
    cpu = CpuTier(CpuTierConfig(capacity_bytes="16MiB", verify_gets=True))
    disk = DiskTier(DiskTierConfig(root=tempfile.mkdtemp(prefix="tierkv-stream-"), fsync=False))
    redis = RedisTier(RedisTierConfig(url=redis_proc.url))
    for tier in (cpu, disk, redis):
        segs = [segment(i, codec) for i in range(6)]
        for s in segs:
            assert await tier.put(s.key, s)
        await check_stream(tier, segs)
        await tier.close()


async def test_a_store_merges_its_tiers_layer_by_layer(redis_proc) -> None:
    """Keys spread over three tiers come as one stream: layer l is ready only once every tier
    delivered it."""
    tiers = [
        CpuTier(CpuTierConfig(capacity_bytes="16MiB")),
        DiskTier(DiskTierConfig(root=tempfile.mkdtemp(prefix="tierkv-stream-"), fsync=False)),
        RedisTier(RedisTierConfig(url=redis_proc.url)),
    ]
    store = TieredStore(tiers, StoreConfig(promote=False))
    segs = [segment(i) for i in range(9)]
    for s, t in zip(segs, tiers * 3):
        assert await t.put(s.key, s)
    sink = await check_stream(store, segs)
    for layer, written in sink.ready_at:
        assert all(written[j] > layer for j in range(9))
    await store.close()


async def test_a_key_deleted_midway_is_dropped_not_delivered() -> None:
    cpu = CpuTier(CpuTierConfig(capacity_bytes="16MiB"))
    segs = [segment(i) for i in range(3)]
    for s in segs:
        assert await cpu.put(s.key, s)
    sink = Sink(3)

    async def delete_after_first(layer: int) -> None:
        if layer == 0:
            await cpu.delete(segs[1].key)

    sink.on_ready = delete_after_first
    await cpu.stream([s.key for s in segs], "default", sink)
    assert sink.dropped == {1: "miss: deleted midway"}
    assert [r for r, _ in sink.ready_at] == list(range(LAYERS))
    assert torch.equal(sink.payload(0), segs[0].payload)
    assert torch.equal(sink.payload(2), segs[2].payload)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(args=["--shm-region-bytes", "1MiB"]).start()
    yield s
    s.stop(kill=True)


@pytest.mark.parametrize("path", ["shm", "tcp", "grpc"])
def test_a_server_streams_over_every_path(server, path: str) -> None:
    """Shared memory (a 1 MiB region: some keys' layers go inline when it is full), the TCP
    port, and gRPC's per-key streams all deliver the same layers."""

    async def run() -> None:
        if path == "grpc":
            t: RemoteTier = RemoteTier(target=server.target)
        else:
            t = DataTier(target=server.target, shared_memory=path == "shm")
        segs = [segment(100 + i) for i in range(24)]  # 1.5 MiB: more than the region
        for s in segs:
            assert await t.put(s.key, s)
        for _ in range(2):  # the second stream reuses the ranges the first released
            with counting() as c:
                await check_stream(t, segs)
            total = sum(s.nbytes for s in segs)
            if path == "shm":  # some keys through the region, the rest inline
                assert 0 < c["stream.copy_out"] < total
            else:
                assert c["stream.copy_out"] == 0
        if path != "grpc":
            assert isinstance(t, DataTier) and t._session is not None
            assert (t._session.region is not None) == (path == "shm")
        assert t.stats().errors == 0
        await t.close()

    asyncio.run(run())


async def test_a_corrupt_file_is_dropped_and_removed(tmp_path) -> None:
    disk = DiskTier(DiskTierConfig(root=tmp_path, fsync=False))
    segs = [segment(i) for i in range(3)]
    for s in segs:
        assert await disk.put(s.key, s)
    path = disk.index[("default", segs[1].key)].path
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # in the last layer
    path.write_bytes(bytes(raw))
    sink = Sink(3)
    await disk.stream([s.key for s in segs], "default", sink)
    assert list(sink.dropped) == [1] and "checksum" in sink.dropped[1]
    assert ("default", segs[1].key) not in disk.index
    for j in (0, 2):
        assert torch.equal(sink.payload(j), segs[j].payload)


def test_a_stream_stays_in_its_namespace() -> None:
    """b streams a's key and its own through shared memory: a's is a miss, and b's region,
    scanned whole, never holds a's bytes."""
    server = ServerProcess(args=["--tokens", "alpha-token=tenant-a,beta-token=tenant-b"]).start()

    async def run() -> None:
        a = DataTier(target=server.target, token="alpha-token")
        b = DataTier(target=server.target, token="beta-token")
        secret, mine = segment(7), segment(8)
        assert await a.put(secret.key, secret)
        assert await b.put(mine.key, mine)
        sink = Sink(2)
        await b.stream([secret.key, mine.key], "default", sink)
        assert sink.dropped == {0: "miss"}
        assert torch.equal(sink.payload(1), mine.payload)
        assert b._session is not None and b._session.region is not None
        region = bytes(b._session.region.map)
        probe = lambda s: s.payload[0, 0, 0].contiguous().view(torch.uint8).numpy().tobytes()
        assert probe(mine) in region and probe(secret) not in region
        await a.close()
        await b.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(kill=True)


def frames(segs: list[KVSegment]) -> bytes:
    """A well-formed inline STREAM reply for segs, as a server sends it."""
    out = HEAD.pack(OK, len(segs), 0)
    for layer in range(LAYERS):
        for i, s in enumerate(segs):
            h = s.full_header()
            head = h.encode() if layer == 0 else b""
            data = s.payload[layer].contiguous().view(torch.uint8).numpy().tobytes()
            out += FRAME.pack(i, layer, len(head), len(data), INLINE) + head + data
    return out


@settings(max_examples=150, deadline=None)
@given(
    cut=st.integers(0, 10**6),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=3),
)
def test_a_client_checks_every_frame(cut: int, flips: list[tuple[int, int]]) -> None:
    """Truncated or altered replies raise or drop keys: the sink is never made ready with a
    byte that differs from the stored segment."""
    segs = [segment(40 + i) for i in range(2)]
    wire = bytearray(frames(segs))
    for at, x in flips:
        wire[at % len(wire)] ^= x
    wire = wire[: len(wire) - cut % 64 if cut % 3 == 0 else len(wire)]

    async def run() -> Sink:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.sendall(bytes(wire))
        theirs.shutdown(socket.SHUT_WR)
        sink = Sink(2)
        try:
            await Session(Conn(ours), None, 1 << 20).stream([s.key for s in segs], sink)
        except (ValueError, EOFError, SegmentError, OSError):
            pass
        finally:
            ours.close()
            theirs.close()
        return sink

    sink = asyncio.run(run())
    for layer, _ in sink.ready_at:
        for j, s in enumerate(segs):
            if j in sink.heads and layer < sink.dropped_after.get(j, LAYERS):
                assert torch.equal(sink.payload(j)[layer], s.payload[layer])


def test_a_key_whose_last_layer_was_never_made_ready_is_dropped() -> None:
    """The session ends after key 0's last layer and before key 1's: that layer is never made
    ready, so key 0 is dropped with key 1 (never left complete but not ready)."""
    segs = [segment(50 + i) for i in range(2)]
    wire = frames(segs)
    last = FRAME.size + segs[1].payload[LAYERS - 1].nbytes

    async def run() -> Sink:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.sendall(wire[:-last])
        theirs.shutdown(socket.SHUT_WR)
        sink = Sink(2)
        try:
            with pytest.raises(EOFError):
                await Session(Conn(ours), None, 1 << 20).stream([s.key for s in segs], sink)
        finally:
            ours.close()
            theirs.close()
        return sink

    sink = asyncio.run(run())
    assert [r for r, _ in sink.ready_at] == list(range(LAYERS - 1))
    assert set(sink.dropped) == {0, 1}


def test_inline_streams_take_memory_from_the_budget_and_give_it_back() -> None:
    """Over TCP each key's layer buffer comes from the server's in-flight budget (256 KiB here,
    16 KiB per layer): keys past it are dropped, not buffered, and the budget comes back."""
    server = ServerProcess(args=["--max-inflight-bytes", "256KiB"]).start()

    async def run() -> None:
        t = DataTier(target=server.target, shared_memory=False)
        segs = [segment(60 + i) for i in range(24)]
        for s in segs:
            assert await t.put(s.key, s)
        for _ in range(2):
            sink = Sink(24)
            await t.stream([s.key for s in segs], "default", sink)
            assert len(sink.dropped) == 24 - 16  # 16 x 16 KiB fit
            assert set(sink.dropped.values()) == {"refused"}
            for j in set(range(24)) - set(sink.dropped):
                assert torch.equal(sink.payload(j), segs[j].payload)
        await t.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(kill=True)


async def test_redis_gone_midway_drops_the_keys_without_raising(redis_proc) -> None:
    redis = RedisTier(RedisTierConfig(url=redis_proc.url, timeout_s=0.5))
    segs = [segment(i) for i in range(4)]
    for s in segs:
        assert await redis.put(s.key, s)
    sink = Sink(4)

    async def kill_after_first(layer: int) -> None:
        if layer == 0:
            redis_proc.stop(kill=True)

    sink.on_ready = kill_after_first
    await redis.stream([s.key for s in segs], "default", sink)
    assert [r for r, _ in sink.ready_at] == [0]
    assert sorted(sink.dropped) == [0, 1, 2, 3]
    assert all(why.startswith("tier error") for why in sink.dropped.values())
    assert redis.stats().errors >= 1
    await redis.close()


async def test_a_sink_that_stops_stops_every_tier(redis_proc) -> None:
    """The connector's sink raises when its job is cancelled: the store's stream raises that,
    after every tier's part ended, and nothing is written after it."""
    tiers = [
        CpuTier(CpuTierConfig(capacity_bytes="16MiB")),
        RedisTier(RedisTierConfig(url=redis_proc.url)),
    ]
    store = TieredStore(tiers, StoreConfig(promote=False))
    segs = [segment(i) for i in range(6)]
    for s, t in zip(segs, tiers * 3):
        assert await t.put(s.key, s)
    sink = Sink(6)

    class Cancelled(Exception):
        pass

    async def stop(layer: int) -> None:
        if layer == 1:
            sink.into = None  # any write from here on fails the test
            raise Cancelled

    sink.on_ready = stop
    with pytest.raises(Cancelled):
        await asyncio.wait_for(store.stream([s.key for s in segs], "default", sink), 10)
    assert [r for r, _ in sink.ready_at] == [0, 1]
    await store.close()
