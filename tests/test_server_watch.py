"""The Watch stream of a real tierkv-server: a namespace's watchers see its keys leave the
server (evicted from the last tier, deleted), never another namespace's; a demotion is no
removal; watchers are limited, bad requests refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
import torch

from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.launch import ServerProcess
from tierkv.proto import tierkv_pb2 as pb

TOKENS = "tok-a-123456=team-a,tok-b-123456=team-b"


def segment(seed: int, parent: bytes = bytes(16), first: int = 0) -> tuple[bytes, object]:
    from tierkv.storage_backends.segment import KVSegment

    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(4, 2, 256, 2, 16, generator=g).to(torch.bfloat16)  # 128 KiB
    key = seed.to_bytes(16, "little")
    tokens = list(range(first, first + 256))
    return key, KVSegment.from_tensor(kv, key=key, parent=parent, tokens=tokens, fingerprint=b"t")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # a cpu tier of 2 segments in front of a disk tier of 4: evictions from cpu demote
    args = ["--cpu-bytes", "512KiB", "--disk-bytes", "600KiB", "--max-watchers", "2"]
    s = ServerProcess(args=[*args, "--tokens", TOKENS]).start()
    yield s
    s.stop(kill=True)


async def collect(tier: RemoteTier, into: list[pb.Removed], ready: asyncio.Event) -> None:
    gen = tier.watch()
    task = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0.3)  # the stream is open once the server has its first message queued
    ready.set()
    try:
        ev = await task
        while True:
            into.extend(ev.removed)
            ev = await gen.__anext__()
    except (StopAsyncIteration, asyncio.CancelledError):
        pass
    finally:
        await gen.aclose()


async def until(cond, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_watch_sees_its_namespace_leave_the_server(server: ServerProcess) -> None:
    a = RemoteTier(target=server.target, token="tok-a-123456")
    b = RemoteTier(target=server.target, token="tok-b-123456")
    seen_a: list[pb.Removed] = []
    seen_b: list[pb.Removed] = []
    ra, rb = asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(collect(a, seen_a, ra)),
        asyncio.create_task(collect(b, seen_b, rb)),
    ]
    try:
        await ra.wait()
        await rb.wait()
        keys = []
        for i in range(1, 4):  # three fit (cpu demotes to disk): nothing leaves the server
            k, seg = segment(i)
            assert await a.put(k, seg)
            keys.append(k)
        await asyncio.sleep(0.5)
        assert seen_a == [] and seen_b == []
        for i in range(4, 12):  # disk holds 4: the oldest leave the server
            k, seg = segment(i)
            assert await a.put(k, seg)
            keys.append(k)
        await until(lambda: len(seen_a) >= 1)
        await asyncio.sleep(0.5)
        gone = {r.key for r in seen_a}
        present = await a.lookup(keys)
        assert present is not None
        assert gone == {k for k, p in zip(keys, present.present) if not p}
        assert all(r.reason == "evicted" and r.tier == "disk" for r in seen_a), seen_a
        assert seen_b == []  # team-b sees nothing of team-a's
        kb, segb = segment(100)
        assert await b.put(kb, segb) and await b.delete(kb)
        await until(lambda: len(seen_b) >= 1)
        await asyncio.sleep(0.3)
        # a put still on its way to the disk tier when the delete came is deleted there too:
        # a removal may be told twice, never missed
        assert {(r.key, r.reason) for r in seen_b} == {(kb, "deleted")}, seen_b
        assert kb not in {r.key for r in seen_a}
        # max_watchers is 2: a third is refused with a message
        c = RemoteTier(target=server.target, token="tok-a-123456")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in c.watch():
                pass
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_watchers" in (err.value.details() or "")
        await c.close()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await a.close()
        await b.close()


async def test_a_watcher_that_asks_is_told_what_is_stored(server: ServerProcess) -> None:
    """With `stored`, a watcher gets its namespace's puts with their tokens and parent, once
    each (a demotion to disk is no new store); a watcher without it and another namespace's
    get none."""
    a = RemoteTier(target=server.target, token="tok-a-123456")
    b = RemoteTier(target=server.target, token="tok-b-123456")
    told: list[pb.WatchEvent] = []
    plain: list[pb.WatchEvent] = []

    async def read(tier: RemoteTier, stored: bool, into: list[pb.WatchEvent]) -> None:
        async for ev in tier.watch(stored=stored):
            into.append(ev)

    tasks = [asyncio.create_task(read(a, True, told)), asyncio.create_task(read(b, False, plain))]
    try:
        await asyncio.sleep(0.3)
        k1, s1 = segment(201)
        k2, s2 = segment(202, parent=k1, first=256)
        assert await a.put(k1, s1) and await a.put(k2, s2)
        kb, sb = segment(203)
        assert await b.put(kb, sb)
        await until(lambda: sum(len(e.stored) for e in told) >= 2)
        await asyncio.sleep(0.5)
        stored = [st for e in told for st in e.stored]
        assert [st.key for st in stored] == [k1, k2]
        assert stored[0].parent == bytes(16) and list(stored[0].tokens) == list(range(256))
        assert stored[1].parent == k1 and list(stored[1].tokens) == list(range(256, 512))
        assert all(not e.stored for e in plain)  # b did not ask, and a's are not b's
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await a.close()
        await b.close()


async def test_watch_refuses_without_a_token(server: ServerProcess) -> None:
    t = RemoteTier(target=server.target)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in t.watch():
            pass
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await t.close()


async def test_a_slow_watcher_loses_events_counted_and_never_blocks(tmp_path) -> None:
    from tierkv.cacheserver.metrics import Metrics
    from tierkv.cacheserver.watch import WatchHub
    from tierkv.storage_backends.disk_tier import DiskTier, DiskTierConfig
    from tierkv.storage_backends.store import TieredStore

    store = TieredStore([DiskTier(DiskTierConfig(root=str(tmp_path), capacity_bytes=1 << 24))])
    metrics = Metrics()
    hub = WatchHub(store, 2, 4, metrics)
    stream = hub.stream("ns")
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # subscribed, waiting for its first event
    keys = []
    for i in range(1, 6):
        k, seg = segment(i)
        assert await store.put(k, seg, "ns") and await store.delete(k, "ns")  # never waits
        keys.append(k)
    await asyncio.sleep(0.1)  # the removals' checks ran
    ev = pb.WatchEvent.FromString(await first)
    got, lost = [r.key for r in ev.removed], ev.dropped
    while len(got) + lost < len(keys):  # drops happen behind queued events: a message follows
        ev = pb.WatchEvent.FromString(await asyncio.wait_for(stream.__anext__(), 5))
        got, lost = got + [r.key for r in ev.removed], lost + ev.dropped
    # a queue of 2 (and at most one more already handed to the sender): the rest were lost
    assert got == keys[: len(got)] and len(got) <= 3 and lost == len(keys) - len(got)
    sample = metrics.registry.get_sample_value
    assert sample("tierkv_watch_dropped_total") == lost and sample("tierkv_watchers") == 1
    await stream.aclose()
    assert hub.count() == 0 and sample("tierkv_watchers") == 0
    await store.close()


def test_watch_refuses_a_malformed_request(server: ServerProcess) -> None:
    auth = [("authorization", "Bearer tok-a-123456")]
    with grpc.insecure_channel(server.target) as ch:
        call = ch.unary_stream(
            "/tierkv.v1.TierKV/Watch",
            request_serializer=lambda b: b,
            response_deserializer=pb.WatchEvent.FromString,
        )
        bad = ((b"\x10\x01", "unknown fields"), (b"\xff\xff\xff", "not a valid WatchRequest"))
        for body, words in bad:
            with pytest.raises(grpc.RpcError) as err:
                list(call(body, metadata=auth, timeout=5))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in (err.value.details() or "")


async def test_a_stopping_server_ends_its_watches_at_once() -> None:
    s = ServerProcess(args=["--tokens", TOKENS]).start()
    t = RemoteTier(target=s.target, token="tok-a-123456")
    ended = asyncio.Event()

    async def watch() -> None:
        try:
            async for _ in t.watch():
                pass
        except grpc.aio.AioRpcError:
            pass
        ended.set()

    task = asyncio.create_task(watch())
    try:
        await asyncio.sleep(0.5)
        t0 = asyncio.get_running_loop().time()
        await asyncio.to_thread(s.stop)  # SIGTERM: a graceful stop (grace_s is 10 s)
        assert asyncio.get_running_loop().time() - t0 < 5
        await asyncio.wait_for(ended.wait(), 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await t.close()
        s.stop(kill=True)
