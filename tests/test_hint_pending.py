"""Hint tags of keys not held, on a real server and real tiers: a hint ahead of the put waits
(pending, bounded per namespace) and applies when the put lands by gRPC or by the data plane's
TCP PUT; a key that moves to a tier with no hint book (real Redis, the server through
RemoteTier) gets its tags back when a get or a prefetch brings it up again."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tierkv.cacheserver.cli import build_store
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.config import ServerConfig
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.server import Server
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.hints import KVHint
from tierkv.storage_backends.redis_tier import RedisTier, RedisTierConfig
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.store import TieredStore

TOKENS = {"token-aaaa": "a", "token-bbbb": "b"}
PAGE = 4096
# coder's prompt is needed in 5 steps, planner's now: under pressure coder's KV goes first
STEPS = {"coder": 5, "planner": 0}


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def segment(i: int) -> KVSegment:
    kv = torch.full((2, 2, 8, 2, 8), float(i % 89)).half()  # 1 KiB: one page
    return KVSegment.from_tensor(kv, key=key(i), tokens=range(8), fingerprint=b"hp")


@pytest.fixture
async def server(tmp_path):
    config = ServerConfig(
        port=0,
        cache_dir=str(tmp_path),
        data_socket="",
        data_port=0,  # the TCP data plane, on a free port
        tokens=TOKENS,
        tiers=TiersConfig(cpu_bytes="32MiB", disk_bytes="0", eviction="hinted", hint_pending=64),
    )
    s = await Server.start(config, build_store(config))
    yield s
    await s.stop()


async def test_a_hint_ahead_of_the_put_applies_by_grpc_and_by_the_data_plane(server) -> None:
    target = f"127.0.0.1:{server.port}"
    a = RemoteTier(target=target, token="token-aaaa")
    data = DataTier(target=target, token="token-aaaa", shared_memory=False)
    b = RemoteTier(target=target, token="token-bbbb")
    cpu = server.store.tiers[0]
    book = cpu.hints
    try:
        hint = KVHint("w", "coder", next_use=STEPS)
        r = await a.hint([key(i) for i in range(4)], hint)
        assert r is not None and r.tagged == 4  # none stored yet: all pending
        assert all(("a", key(i)) in book.pending for i in range(4))
        r = await b.hint([key(0)], KVHint("w", "planner", next_use=STEPS))
        assert r is not None and r.tagged == 1
        for i in (0, 1):
            assert await a.put(key(i), segment(i))  # gRPC Put
        for i in (2, 3):
            assert await data.put(key(i), segment(i))  # the data plane's TCP PUT
        assert data.session_open
        assert [cpu.hints.rank("a", key(i)) for i in range(4)] == [5] * 4
        assert not any(("a", key(i)) in book.pending for i in range(4))
        assert book.stats.applied == 4
        assert ("b", key(0)) in book.pending  # b's hint is b's: a's put does not take it
        assert book.tags_of("a", key(0)) == [("w", "coder")]
        server.store.check_integrity()
    finally:
        for t in (a, data, b):
            await t.close()


async def test_hints_and_puts_racing_leave_every_key_tagged_and_the_book_balanced(server):
    target = f"127.0.0.1:{server.port}"
    a = RemoteTier(target=target, token="token-aaaa")
    data = DataTier(target=target, token="token-aaaa", shared_memory=False)
    book = server.store.tiers[0].hints
    hint = KVHint("w", "coder", next_use=STEPS)
    try:
        calls = []
        for i in range(40):  # each key's hint and put in flight together, either may land first
            calls.append(a.hint([key(i)], hint))
            calls.append((a if i % 2 else data).put(key(i), segment(i)))
        results = await asyncio.gather(*calls)
        assert all(r is not None and r is not False for r in results)
        cpu = server.store.tiers[0]
        assert all(("a", key(i)) in cpu.index for i in range(40))  # all held (nothing evicted)
        assert [book.rank("a", key(i)) for i in range(40)] == [5] * 40
        assert book.pending.count("a") == 0
        server.store.check_integrity()
    finally:
        await a.close()
        await data.close()


async def test_pending_hints_of_a_client_are_bounded_per_namespace(server) -> None:
    target = f"127.0.0.1:{server.port}"
    a = RemoteTier(target=target, token="token-aaaa")
    b = RemoteTier(target=target, token="token-bbbb")
    book = server.store.tiers[0].hints
    try:
        hint = KVHint("w", "coder", next_use=STEPS)
        r = await b.hint([key(i) for i in range(10)], hint)
        assert r is not None and r.tagged == 10
        r = await a.hint([key(i) for i in range(1000, 3000)], hint)  # never stored
        assert r is not None and r.tagged == 2000
        assert book.pending.count("a") == 64 and book.tags.count("a") == 64
        assert book.stats.dropped == 2000 - 64  # the oldest went first, counted
        assert ("a", key(2999)) in book.pending and ("a", key(1000)) not in book.tags
        assert book.pending.count("b") == 10  # a's flood leaves b's hints alone
        server.store.check_integrity()
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("slow", ["redis", "server"])
async def test_tags_come_back_with_kv_from_a_tier_without_a_book(slow, server, redis_proc):
    lower = (
        RedisTier(RedisTierConfig(url=redis_proc.url))
        if slow == "redis"
        else RemoteTier(target=f"127.0.0.1:{server.port}", token="token-aaaa")
    )
    cpu = CpuTier(CpuTierConfig(capacity_bytes=8 * PAGE, page_bytes=PAGE, eviction="hinted"))
    store = TieredStore([cpu, lower])
    book = cpu.hints
    try:
        store.hint([key(i) for i in range(4)], "t", KVHint("w", "coder", next_use=STEPS))
        for i in range(4):
            assert await store.put(key(i), segment(i), "t")
        fill = [key(i) for i in range(10, 18)]
        store.hint(fill, "t", KVHint("w", "planner", next_use=STEPS))
        for i in range(10, 18):  # the planner's KV pushes coder's down into `lower`
            assert await store.put(key(i), segment(i), "t")
        await store.drain()
        assert not any(("t", key(i)) in cpu.index for i in range(4))
        assert all(await lower.contains([key(i) for i in range(4)], "t"))
        assert all(("t", key(i)) in book.pending for i in range(4))  # kept while away
        store.check_integrity()

        applied = book.stats.applied
        for i, how in ((0, "get"), (1, "prefetch")):
            if how == "get":  # a hit below, promoted into the cpu tier
                got = await store.get(key(i), "t")
                assert got is not None and torch.equal(got.payload, segment(i).payload)
            else:
                assert store.prefetch([key(i)], "t") == 1
            await store.drain()
            assert ("t", key(i)) in cpu.index
            assert book.tags_of("t", key(i)) == [("w", "coder")]
            assert cpu.hints.rank("t", key(i)) == 5 and ("t", key(i)) not in book.pending
            store.check_integrity()
        assert book.stats.applied == applied + 2
        store.check_integrity()
    finally:
        await store.close()
