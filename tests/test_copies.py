"""Payload copies per process hop, counted by the code itself (tierkv.storage_backends.copies):
one segment saved client -> server -> Redis, then loaded back over gRPC and over shared memory
from the server's cpu tier and from Redis. The counts are docs/architecture.md's copy table."""

from __future__ import annotations

from collections import Counter

import torch

from tierkv.cacheserver.cli import build_store
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.config import ServerConfig
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.server import Server
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.copies import copied, counting
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.names import DEFAULT_NAMESPACE as NS
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.store import StoreConfig, TieredStore


def segment(key: bytes = b"k" * 16) -> KVSegment:
    kv = torch.randn(4, 2, 256, 2, 64, generator=torch.Generator().manual_seed(3))
    seg = KVSegment.from_tensor(
        kv.to(torch.bfloat16), key=key, tokens=list(range(256)), fingerprint=b"f" * 16
    )
    seg.owned = True  # handed over, as the connector hands over its staging tensors
    return seg


class Copying:
    """A LayerSink whose layers are copied into its buffer."""

    def __init__(self) -> None:
        self.layers: dict[int, bytes | memoryview] = {}

    def open(self, i: int, header: SegmentHeader) -> bool:
        self.n = header.layer_raw_nbytes
        self.buf = memoryview(bytearray(header.payload_raw_nbytes))
        return True

    def into(self, i: int, layer: int) -> memoryview:
        self.layers[layer] = self.buf[layer * self.n : (layer + 1) * self.n]
        return self.layers[layer]

    def drop(self, i: int, why: str) -> None:
        raise AssertionError(f"key {i} dropped: {why}")

    async def ready(self, layer: int) -> None:
        self.layers[layer] = bytes(self.layers[layer])  # what a scatter would read, now

    def payload(self, seg: KVSegment) -> torch.Tensor:
        raw = bytearray(b"".join(self.layers[i] for i in range(len(self.layers))))
        return torch.frombuffer(raw, dtype=seg.payload.dtype).view(seg.payload.shape)


class Placing(Copying):
    """A LayerSink that reads the layers where they lie (the region), in its `ready`."""

    def place(self, i: int, layer: int, data: memoryview) -> None:
        self.layers[layer] = data


def nonzero(c: Counter[str]) -> dict[str, int]:
    return {k: v for k, v in sorted(c.items()) if v}


def test_the_counter_counts_only_while_on() -> None:
    copied("x", 5)
    with counting() as c:
        copied("x", 7)
        copied("x", 1)
    copied("x", 9)
    assert nonzero(c) == {"x": 8}


async def test_copies_per_hop_save_and_load(redis_proc, tmp_path) -> None:
    config = ServerConfig(
        port=0,
        cache_dir=str(tmp_path),
        tiers=TiersConfig(cpu_bytes=64 << 20, disk_bytes=64 << 20, redis_url=redis_proc.url),
    )
    server = await Server.start(config, build_store(config))
    target = f"127.0.0.1:{server.port}"
    seg = segment()
    whole, payload = seg.nbytes, seg.payload.numel() * seg.payload.element_size()

    def client(remote: RemoteTier) -> TieredStore:
        return TieredStore([CpuTier(CpuTierConfig("16MiB")), remote], StoreConfig())

    try:
        # Save: the client's cpu tier keeps a copy; its write-behind job sends the segment it
        # was handed (no read-back); gRPC frames it (1); the server receives it (1), keeps a
        # copy in its cpu tier and writes disk and Redis from the received bytes (no encode).
        saver = client(RemoteTier(target=target))
        with counting() as c:
            assert await saver.put(seg.key, seg)
            await saver.drain()
            await server.store.drain()
        assert nonzero(c) == {"cpu.put": 2 * whole, "server.receive": whole, "wire.frame": whole}
        assert [await t.contains([seg.key]) for t in server.store.tiers] == [[True]] * 3

        # Save over the data plane (a Unix socket or TCP): the bytes leave from the segment
        # and land in the server's cpu-tier pages by the kernel's copies alone; the write-behind
        # to disk and Redis reads them back (1), after the put was answered.
        for i, shm in enumerate((True, False)):
            other = segment(bytes([i]) * 16)
            data_saver = client(DataTier(target=target, shared_memory=shm))
            with counting() as c:
                assert await data_saver.put(other.key, other)
                await data_saver.drain()
                await server.store.drain()
            assert nonzero(c) == {"cpu.put": whole, "cpu.get": whole}
            assert data_saver.tiers[1]._session is not None
            await data_saver.close()

        # Load over gRPC from Redis: frames from the bytes Redis returned (1 in the server),
        # assembled (1 in the client); promotions into both cpu tiers run in the background.
        for t in server.store.tiers[:2]:
            assert await t.delete(seg.key, NS)
        loader = client(RemoteTier(target=target))
        with counting() as c:
            got = await loader.get(seg.key)
            assert got is not None and torch.equal(got.payload, seg.payload)
            loads = nonzero(c)
            await loader.drain()
            await server.store.drain()
        loads.pop("cpu.put", None)  # the server's queued promotion may run beside the stream
        assert loads == {"wire.assemble": payload, "wire.frame": payload}
        assert nonzero(c)["cpu.put"] == 2 * whole  # the two promotions

        # Over shared memory: from the server's cpu-tier pages straight into the region (1),
        # out of the region (1); from Redis, copied into the region (1), out of it (1).
        for from_redis in (False, True):
            if from_redis:
                for t in server.store.tiers[:2]:
                    assert await t.delete(seg.key, NS)
            shm = DataTier(target=target)
            with counting() as c:
                got = await shm.get(seg.key)
                assert got is not None and torch.equal(got.payload, seg.payload)
                await server.store.drain()
            loads = nonzero(c)
            assert loads.pop("cpu.put", 0) == (whole if from_redis else 0)  # promotion, queued
            assert loads == {"shm.copy_in": payload, "shm.copy_out": payload}
            await shm.close()
            await server.store.drain()
        # A STREAM over shared memory: each layer out of the region into the sink's buffer (1),
        # or none where the sink reads it in place (`place`, its own scatter reads the region).
        for t in server.store.tiers[:2]:
            assert await t.put(seg.key, seg, NS)
        shm = DataTier(target=target)
        for sink in (Copying(), Placing()):
            with counting() as c:
                await shm.stream([seg.key], NS, sink)
            assert torch.equal(sink.payload(seg), seg.payload)
            assert c["stream.copy_out"] == (0 if isinstance(sink, Placing) else payload)
        await shm.close()
        # Over TCP: the kernel's copies only, from the server's cpu-tier pages (sent as they
        # are) straight into the client's buffer; from Redis, none of ours either.
        for from_redis in (False, True):
            if from_redis:
                for t in server.store.tiers[:2]:
                    assert await t.delete(seg.key, NS)
            tcp = DataTier(target=target, shared_memory=False)
            with counting() as c:
                got = await tcp.get(seg.key)
                assert got is not None and torch.equal(got.payload, seg.payload)
                await server.store.drain()
            assert tcp._session is not None and tcp._session.region is None
            loads = nonzero(c)
            assert loads.pop("cpu.put", 0) == (whole if from_redis else 0)  # promotion, queued
            assert loads == {}
            await tcp.close()
        await saver.close()
        await loader.close()
    finally:
        await server.stop()
