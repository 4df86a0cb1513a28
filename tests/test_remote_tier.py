"""RemoteTier against real servers: concurrency with every byte checked, retries, faults as
misses, unverified data never handed out, and graceful shutdown of in-flight puts."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import torch

from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.frames import pieces, put_frames
from tierkv.cacheserver.launch import ServerProcess, free_port
from tierkv.proto import tierkv_pb2 as pb
from tierkv.proto import tierkv_pb2_grpc as pb_grpc
from tierkv.storage_backends.segment import KVSegment, decode_layer


def segment(seed: int, layers: int = 4, tokens: int = 128) -> KVSegment:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, tokens, 4, 64, generator=g).half()  # 128 KiB layers
    return KVSegment.from_tensor(
        kv, key=seed.to_bytes(16, "little"), tokens=list(range(tokens)), fingerprint=b"t"
    )


async def test_eight_concurrent_clients_every_byte(tmp_path) -> None:
    server = ServerProcess().start()
    try:
        shared = [segment(1000 + i) for i in range(2)]
        own = {c: [segment(c * 10 + i) for i in range(3)] for c in range(8)}
        clients = [RemoteTier(target=server.target, frame_bytes=48 << 10) for _ in range(8)]

        async def client(c: int) -> None:
            t = clients[c]
            for s in own[c] + shared:  # identical keys put by everyone at once
                assert await t.put(s.key, s)
            await asyncio.sleep(0)
            for s in shared + [x for o in own.values() for x in o]:
                got = await t.get(s.key)
                if got is None:  # another client's put may not have landed yet
                    await asyncio.sleep(0.2)
                    got = await t.get(s.key)
                assert got is not None and torch.equal(got.payload, s.payload) and got.key == s.key
                seen = 0
                async for chunk in t.get_layers(s.key):
                    assert torch.equal(
                        decode_layer(chunk.header, chunk.layer, chunk.data), s.layer(chunk.layer)
                    )
                    seen += 1
                assert seen == s.num_layers

        await asyncio.gather(*(client(c) for c in range(8)))
        st = await clients[0].server_stats()
        assert [t.count for t in st.tiers if t.name == "cpu"] == [26] and st.puts == 8 * 5
        for t in clients:
            await t.close()
    finally:
        server.stop(kill=True)


async def test_get_into_out() -> None:
    server = ServerProcess().start()
    tier = RemoteTier(target=server.target)
    try:
        s = segment(5)
        assert await tier.put(s.key, s)
        out = torch.empty(s.payload.numel() + 10, dtype=torch.float16)
        got = await tier.get(s.key, out=out)
        assert got.payload.data_ptr() == out.data_ptr() and torch.equal(got.payload, s.payload)
        buf = bytearray(s.payload.numel() * 2)
        got = await tier.get(s.key, out=buf)
        assert (
            torch.equal(got.payload, s.payload)
            and bytes(buf) == s.payload.view(torch.uint8).numpy().tobytes()
        )
        assert (
            await tier.get(s.key, out=bytearray(10)) is None
        )  # too small: refused, nothing written
    finally:
        await tier.close()
        server.stop(kill=True)


async def test_retries_until_the_server_is_up() -> None:
    server = ServerProcess()
    tier = RemoteTier(target=server.target, retries=10, backoff_s=0.1, timeout_s=5)
    s = segment(1)
    try:
        starting = asyncio.create_task(asyncio.to_thread(server.start))
        assert await tier.put(s.key, s)  # UNAVAILABLE until the process listens
        await starting
        assert torch.equal((await tier.get(s.key)).payload, s.payload)
    finally:
        await tier.close()
        server.stop(kill=True)


async def test_server_down_is_a_miss_never_an_error() -> None:
    tier = RemoteTier(target=f"127.0.0.1:{free_port()}", retries=1, backoff_s=0.01, timeout_s=2)
    s = segment(2)
    t0 = time.monotonic()
    assert await tier.get(s.key) is None and await tier.contains([s.key]) == [False]
    assert not await tier.put(s.key, s) and not await tier.delete(s.key)
    assert [c async for c in tier.get_layers(s.key)] == [] and await tier.server_stats() is None
    assert time.monotonic() - t0 < 20 and tier.stats().errors >= 5
    with pytest.raises(ValueError):
        await tier.get(b"short")
    await tier.close()


class Tampering(pb_grpc.TierKVServicer):
    """A real gRPC server that serves a segment with one payload byte flipped in layer `bad`."""

    def __init__(self, seg: KVSegment, bad: int) -> None:
        _, parts = pieces(seg)
        self.parts = [bytes(p) for p in parts]
        self.parts[1 + bad] = bytes([self.parts[1 + bad][0] ^ 1]) + self.parts[1 + bad][1:]
        self.total = sum(len(p) for p in self.parts)

    async def Get(self, request, context):
        yield pb.SegmentFrame(
            kind=pb.SegmentFrame.HEADER, data=self.parts[0], total_bytes=self.total
        )
        for i, p in enumerate(self.parts[1:]):
            yield pb.SegmentFrame(kind=pb.SegmentFrame.LAYER, layer=i, data=p)


async def test_tampered_data_is_never_handed_out() -> None:
    s = segment(3)
    srv = grpc.aio.server()
    pb_grpc.add_TierKVServicer_to_server(Tampering(s, bad=2), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    tier = RemoteTier(target=f"127.0.0.1:{port}", retries=0)
    try:
        assert await tier.get(s.key) is None
        layers = [c.layer async for c in tier.get_layers(s.key)]
        assert layers == [0, 1]  # checked layers only; the stream stops at the bad one
        assert tier.stats().errors == 2
    finally:
        await tier.close()
        await srv.stop(0)


class Stalling(pb_grpc.TierKVServicer):
    """Serves a segment's header and layer 0, then holds the stream until `go` is set."""

    def __init__(self, seg: KVSegment) -> None:
        total, parts = pieces(seg)
        self.parts, self.total, self.go = [bytes(p) for p in parts], total, asyncio.Event()

    async def Get(self, request, context):
        yield pb.SegmentFrame(
            kind=pb.SegmentFrame.HEADER, data=self.parts[0], total_bytes=self.total
        )
        for i, p in enumerate(self.parts[1:]):
            if i == 1:
                await self.go.wait()
            yield pb.SegmentFrame(kind=pb.SegmentFrame.LAYER, layer=i, data=p)


async def test_get_layers_yields_a_layer_as_soon_as_it_arrived() -> None:
    s = segment(4)
    servicer = Stalling(s)
    srv = grpc.aio.server()
    pb_grpc.add_TierKVServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    tier = RemoteTier(target=f"127.0.0.1:{port}", retries=0)
    try:
        layers = tier.get_layers(s.key)
        first = await asyncio.wait_for(anext(layers), 10)  # while the server still holds layer 1
        assert first.layer == 0 and not servicer.go.is_set()
        assert torch.equal(decode_layer(first.header, 0, first.data), s.layer(0))
        servicer.go.set()
        assert [c.layer async for c in layers] == [1, 2, 3]
    finally:
        await tier.close()
        await srv.stop(0)


def test_sigterm_finishes_or_discards_in_flight_puts() -> None:
    server = ServerProcess(args=["--grace-s", "3"]).start()
    done, stalled, early = segment(10), segment(11), segment(12)
    release = threading.Event()
    results: dict[str, object] = {}

    def slow_put(name: str, seg: KVSegment, gate: threading.Event | None) -> None:
        frames = list(put_frames(seg.key, seg, 64 << 10))

        def gen():
            yield from frames[:3]
            if gate is None:
                time.sleep(60)  # never completes: the server must discard it whole
            else:
                gate.wait(30)
            yield from frames[3:]

        with grpc.insecure_channel(server.target) as ch:
            try:
                results[name] = pb_grpc.TierKVStub(ch).Put(gen(), timeout=30).stored
            except grpc.RpcError as e:
                results[name] = e.code()

    with grpc.insecure_channel(server.target) as ch:
        assert pb_grpc.TierKVStub(ch).Put(put_frames(early.key, early)).stored
    threads = [
        threading.Thread(target=slow_put, args=("done", done, release), daemon=True),
        threading.Thread(target=slow_put, args=("stalled", stalled, None), daemon=True),
    ]
    for t in threads:
        t.start()
    time.sleep(1.5)  # both streams are in flight
    server.proc.terminate()
    time.sleep(0.3)
    release.set()  # "done" completes within the grace period
    assert server.proc.wait(30) == 0
    threads[0].join(10)
    assert results["done"] is True and results.get("stalled") in (
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNAVAILABLE,
    )
    server.start()  # same cache directory: the disk tier holds what was stored, nothing else
    with grpc.insecure_channel(server.target) as ch:
        r = pb_grpc.TierKVStub(ch).Lookup(pb.LookupRequest(keys=[early.key, done.key, stalled.key]))
        assert list(r.present) == [True, True, False] and list(r.tier[:2]) == ["disk", "disk"]
    files = sorted(p.name for p in (server.cache_dir / "disk").rglob("*") if p.is_file())
    assert files == sorted(f"{s.key.hex()}.tkv" for s in (early, done))
    server.stop(kill=True)


async def test_concurrent_gets_share_one_stream_and_keep_their_answers() -> None:
    """A request's chunk loads go out together: each key gets its own segment or miss back,
    into its own `out` when given."""
    server = ServerProcess().start()
    try:
        tier = RemoteTier(target=server.target)
        segs = [segment(i) for i in range(1, 13)]
        for s in segs:
            assert await tier.put(s.key, s)
        keys = [s.key for s in segs] + [bytes(16), b"\x99" * 16]
        outs = [torch.empty(s.payload.numel(), dtype=s.payload.dtype) for s in segs]
        got = await asyncio.gather(
            *(tier.get(k, out=o) for k, o in zip(keys, outs + [None, None], strict=True))
        )
        assert got[-2:] == [None, None]
        for g, s, o in zip(got, segs, outs, strict=False):
            assert g is not None and torch.equal(g.payload, s.payload)
            assert g.payload.data_ptr() == o.data_ptr()
        assert tier.stats().errors == 0
        await tier.close()
    finally:
        server.stop(kill=True)
