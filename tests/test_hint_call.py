"""The cache server's Hint call over its real gRPC port, and prefetch up real tiers: hostile
hints are refused naming the field and change nothing; a namespace's hint never reaches
another's entries; keys only in disk or Redis move up to the cpu tier."""

from __future__ import annotations

import asyncio
import copy
import json
import time

import grpc
import pytest
import torch

from tierkv.cacheserver.auth import bearer
from tierkv.cacheserver.channel import channel
from tierkv.cacheserver.cli import build_store
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.config import ServerConfig
from tierkv.cacheserver.server import Server
from tierkv.proto import tierkv_pb2 as pb
from tierkv.proto import tierkv_pb2_grpc as pb_grpc
from tierkv.storage_backends.build import TiersConfig
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.disk_tier import DiskTier, DiskTierConfig
from tierkv.storage_backends.hint_book import PINNED
from tierkv.storage_backends.hints import MAX_STEPS, NEVER, KVHint
from tierkv.storage_backends.redis_tier import RedisTier, RedisTierConfig
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.store import TieredStore

TOKENS = {"token-aaaa": "a", "token-bbbb": "b"}
HINT = {"workflow": "w", "agent": "coder", "next_use": {"coder": 1, "reviewer": 3}}


def segment(i: int) -> KVSegment:
    kv = torch.full((2, 2, 64, 2, 16), float(i % 89)).half()
    return KVSegment.from_tensor(kv, key=key(i), tokens=range(64), fingerprint=b"hc")


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


async def until(cond, timeout: float = 10.0) -> None:
    """Poll cond() (an awaitable factory) until true; fail after timeout."""
    end = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


@pytest.fixture
async def server(tmp_path):
    config = ServerConfig(
        port=0,
        cache_dir=str(tmp_path),
        data_socket="",
        data_port=-1,
        tokens=TOKENS,
        max_pin_s=60.0,
        tiers=TiersConfig(cpu_bytes="4MiB", disk_bytes="64MiB", eviction="hinted"),
    )
    s = await Server.start(config, build_store(config))
    yield s
    await s.stop()


def book_state(s: Server):
    return [copy.deepcopy((t.hints.tables, t.hints.tags, t.hints.pins)) for t in s.store.tiers]


async def test_hint_tags_pins_and_stays_in_its_namespace(server) -> None:
    target = f"127.0.0.1:{server.port}"
    a = RemoteTier(target=target, token="token-aaaa")
    b = RemoteTier(target=target, token="token-bbbb")
    cpu = server.store.tiers[0]
    try:
        for i in range(4):
            assert await a.put(key(i), segment(i))
            assert await b.put(key(i), segment(i))
        b_before = [cpu.hints.rank("b", key(i)) for i in range(4)]
        b_order = list(cpu.policy.order(cpu, [(x, 1) for x in cpu.index if x[0] == "b"], "b", 1))
        hint = KVHint("w", "coder", next_use={"coder": 1, "reviewer": 3})
        r = await a.hint([key(0), key(1), key(99)], hint, pin_ttl_s=0)
        assert r is not None and r.tagged == 3 and r.pinned == 0  # key 99 is not held: pending
        assert cpu.hints.rank("a", key(0)) == 1 and cpu.hints.rank("a", key(2)) == NEVER
        assert ("a", key(99)) in cpu.hints.pending and ("a", key(0)) not in cpu.hints.pending
        r = await a.hint([key(2)], None, pin_ttl_s=30)
        assert r is not None and r.pinned == 1 and cpu.hints.rank("a", key(2)) == PINNED
        # b's entries, the same keys, rank and order as before a's hints
        assert [cpu.hints.rank("b", key(i)) for i in range(4)] == b_before
        assert list(cpu.policy.order(cpu, [(x, 1) for x in cpu.index if x[0] == "b"], "b", 1)) == (
            b_order
        )
        # b hinting keys it never stored tags them pending in b, nothing of a's
        r = await b.hint([key(50)], hint)
        assert r is not None and r.tagged == 1
        assert ("b", key(50)) in cpu.hints.pending and ("a", key(50)) not in cpu.hints.tags
        assert cpu.hints.rank("a", key(0)) == 1
        server.store.check_integrity()
        # Stats tells each namespace its own hint entries only; the exporter their totals
        sa, sb = await a.server_stats(), await b.server_stats()
        assert sa is not None and sb is not None
        assert (sa.hints.tagged, sa.hints.pinned, sa.hints.pending) == (3, 1, 1)
        assert (sb.hints.tagged, sb.hints.pinned, sb.hints.pending) == (1, 0, 1)
        server.refresh_metrics()
        got = {m.name: m.samples[0].value for m in server.metrics.hints.collect()}
        assert got["tierkv_hint_tagged"] == 4 and got["tierkv_hint_pending"] == 2
        assert got["tierkv_hint_pinned"] == 1 and got["tierkv_hint_dropped"] == 0
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize(
    "req, field",
    [
        (pb.HintRequest(hint_json="{not json", keys=[key(0)]), "hint_json"),
        (pb.HintRequest(hint_json=json.dumps({**HINT, "agent": "bad agent!"})), "hint_json.agent"),
        (
            pb.HintRequest(hint_json=json.dumps({**HINT, "next_use": {"coder": -1}})),
            "hint_json.next_use.coder",
        ),
        (
            pb.HintRequest(
                hint_json=json.dumps(
                    {"workflow": "w", "agent": "a", "graph": {"steps": [["a"]] * (MAX_STEPS + 1)}}
                )
            ),
            "hint_json.graph.steps",
        ),
        (pb.HintRequest(hint_json=json.dumps({**HINT, "extra": 1})), "hint_json.extra"),
        (pb.HintRequest(hint_json=json.dumps({**HINT, "workflow": "w" * 70000})), "hint_json"),
        (pb.HintRequest(hint_json="[" * 100000 + "]" * 100000), "hint_json"),
        (pb.HintRequest(hint_json=json.dumps(HINT), keys=[b"short"]), "keys[0]"),
        (pb.HintRequest(hint_json=json.dumps(HINT), keys=[key(i) for i in range(5000)]), "keys"),
        (pb.HintRequest(keys=[key(0)], pin_ttl_s=-1.0), "pin_ttl_s"),
        (pb.HintRequest(keys=[key(0)], pin_ttl_s=1e12), "pin_ttl_s"),
        (pb.HintRequest(keys=[key(0)], pin_ttl_s=float("nan")), "pin_ttl_s"),
    ],
)
async def test_hostile_hints_are_refused_naming_the_field(server, req, field: str) -> None:
    target = f"127.0.0.1:{server.port}"
    a = RemoteTier(target=target, token="token-aaaa")
    try:
        for i in range(3):
            assert await a.put(key(i), segment(i))
        ok = await a.hint([key(0)], KVHint("w", "coder", next_use={"coder": 0}), pin_ttl_s=5)
        assert ok is not None and ok.tagged == 1
        before = book_state(server)
        async with channel(target) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pb_grpc.TierKVStub(ch).Hint(req, metadata=bearer("token-aaaa"), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (e.value.details() or "").startswith(field)
        assert book_state(server) == before  # nothing changed
        async with channel(target) as ch:  # no token, another's: never reaches a's entries
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pb_grpc.TierKVStub(ch).Hint(req, metadata=bearer("token-zzzz"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await a.close()


async def test_unknown_agents_and_stale_hints_are_ignored(server) -> None:
    a = RemoteTier(target=f"127.0.0.1:{server.port}", token="token-aaaa")
    try:
        assert await a.put(key(0), segment(0))
        hint = KVHint("w", "ghost", next_use={"planner": 2})  # the agent is in no table
        r = await a.hint([key(0)], hint)
        assert r is not None and r.tagged == 1
        assert server.store.tiers[0].hints.rank("a", key(0)) == NEVER  # LRU, as unhinted
        assert await a.get(key(0)) is not None
    finally:
        await a.close()


async def test_hint_prefetch_moves_disk_keys_to_the_cpu_tier(server) -> None:
    cpu, disk = server.store.tiers[:2]
    a = RemoteTier(target=f"127.0.0.1:{server.port}", token="token-aaaa")
    try:
        for i in range(5):
            assert await disk.put(key(i), segment(i), "a")  # only on disk
        assert not any(await cpu.contains([key(i) for i in range(5)], "a"))
        r = await a.hint([key(i) for i in range(6)], None, prefetch=True)
        assert r is not None and r.prefetching == 6

        async def moved() -> bool:
            return all(await cpu.contains([key(i) for i in range(5)], "a"))

        await until(moved)
        assert server.store.prefetcher.stats.missed == 1  # key 5 is nowhere
    finally:
        await a.close()


@pytest.mark.parametrize("slow", ["disk", "redis"])
async def test_prefetch_up_the_tiers_and_a_get_meanwhile(slow, tmp_path, redis_proc) -> None:
    lower = (
        DiskTier(DiskTierConfig(root=tmp_path, capacity_bytes="64MiB"))
        if slow == "disk"
        else RedisTier(RedisTierConfig(url=redis_proc.url))
    )
    cpu = CpuTier(CpuTierConfig(capacity_bytes="8MiB"))
    store = TieredStore([cpu, lower])
    try:
        segs = [segment(i) for i in range(20)]
        for s in segs:
            assert await lower.put(s.key, s, "t")
        keys = [s.key for s in segs]
        assert store.prefetch(keys, "t") == 20
        assert store.prefetch(keys, "t") == 0  # being prefetched: not read twice
        got = await store.get(keys[7], "t")  # meanwhile: read normally, the right bytes
        assert got is not None and torch.equal(got.payload, segs[7].payload)

        async def moved() -> bool:
            return all(await cpu.contains(keys, "t"))

        await until(moved)
        for s in segs:
            g = await cpu.get(s.key, "t")
            assert g is not None and torch.equal(g.payload, s.payload)
        assert store.prefetcher.stats.missed == 0
        store.check_integrity()
    finally:
        await store.close()
