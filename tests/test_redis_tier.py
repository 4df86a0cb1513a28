"""The Redis tier against real redis-server processes: standalone and a 3-node cluster."""

from __future__ import annotations

import asyncio
import logging
import signal

import pytest
import redis
import torch

from tierkv.cacheserver.launch import RedisProcess
from tierkv.storage_backends.redis_tier import RedisTier, RedisTierConfig
from tierkv.storage_backends.segment import KVSegment, decode_layer


def segment(seed: int, layers: int = 3, tokens: int = 16) -> KVSegment:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, tokens, 2, 8, generator=g).to(torch.float16)
    key = seed.to_bytes(16, "little")
    return KVSegment.from_tensor(
        kv, key=key, tokens=list(range(seed, seed + tokens)), fingerprint=b"fp"
    )


def tier_for(url: str, timeout_s: float = 5.0, **kw) -> RedisTier:
    # A generous timeout: a loaded CI machine can take seconds to answer CLUSTER SLOTS.
    return RedisTier(
        RedisTierConfig(url=url, timeout_s=timeout_s, backoff_s=0.2, max_backoff_s=0.5, **kw)
    )


async def round_trip(tier: RedisTier) -> None:
    segs = [segment(i) for i in range(1, 9)]
    for s in segs:
        assert await tier.put(s.key, s)
    keys = [s.key for s in segs] + [bytes(16)]
    assert await tier.contains(keys) == [True] * 8 + [False]
    for s in segs:
        got = await tier.get(s.key)
        assert (
            got is not None
            and torch.equal(got.payload, s.payload)
            and got.tokens.tolist() == s.tokens.tolist()
        )
        layers = [c async for c in tier.get_layers(s.key)]
        assert [c.layer for c in layers] == [0, 1, 2]
        for c in layers:
            assert torch.equal(decode_layer(c.header, c.layer, c.data), s.layer(c.layer))
    assert await tier.get(bytes(16)) is None
    assert [c async for c in tier.get_layers(bytes(16))] == []
    assert await tier.scan_count() == 8 and tier.count() == 8
    assert await tier.delete(segs[0].key) and not await tier.delete(segs[0].key)
    assert await tier.contains([segs[0].key]) == [False]
    out = torch.empty(segs[1].payload.numel(), dtype=torch.float16)
    got = await tier.get(segs[1].key, out=out)
    assert got.payload.data_ptr() == out.data_ptr() and torch.equal(
        out.view_as(segs[1].payload), segs[1].payload
    )
    st = tier.stats()
    assert st.hits >= 16 and st.misses >= 2 and st.puts == 8 and st.errors == 0


async def test_standalone_round_trip(redis_proc: RedisProcess) -> None:
    tier = tier_for(redis_proc.url)
    await round_trip(tier)
    await tier.close()


async def test_more_concurrent_commands_than_connections_wait(redis_proc) -> None:
    """A request's chunk loads all go at once: past max_connections they queue for a free
    connection instead of failing (which would turn them into misses)."""
    tier = tier_for(redis_proc.url, max_connections=4)
    segs = [segment(i) for i in range(100, 200)]
    assert all(await asyncio.gather(*(tier.put(s.key, s) for s in segs)))
    got = await asyncio.gather(*(tier.get(s.key) for s in segs))
    assert all(g is not None and torch.equal(g.payload, s.payload) for g, s in zip(got, segs))
    assert tier.stats().errors == 0
    await tier.close()


async def test_cluster_round_trip(redis_cluster) -> None:
    tier = tier_for(redis_cluster.url, cluster=True)
    await round_trip(tier)
    # Keys spread over the masters: no hash tag pins them to one slot.
    sizes = [redis.Redis(port=n.port).dbsize() for n in redis_cluster.nodes]
    assert sum(1 for n in sizes if n > 0) >= 2
    await tier.close()
    url = redis_cluster.url.replace("redis://", "redis+cluster://")
    other = tier_for(url)
    assert await other.contains([segment(2).key]) == [True]
    await other.close()


async def test_namespaces_isolated(redis_proc: RedisProcess) -> None:
    tier = tier_for(redis_proc.url)
    s = segment(5)
    assert await tier.put(s.key, s, ns="a")
    assert await tier.contains([s.key], ns="b") == [False]
    assert await tier.get(s.key, ns="b") is None
    assert not await tier.delete(s.key, ns="b")
    assert await tier.scan_count("b") == 0 and await tier.scan_count("a") == 1
    with pytest.raises(ValueError):
        await tier.get(s.key, ns="a:b")
    with pytest.raises(ValueError):
        await tier.get(b"short", ns="a")
    await tier.close()


async def test_ttl(redis_proc: RedisProcess) -> None:
    tier = tier_for(redis_proc.url, ttl_s=30)
    s = segment(6)
    await tier.put(s.key, s)
    ttl = redis.Redis(port=redis_proc.port).ttl(f"tierkv:default:{s.key.hex()}")
    assert 0 < ttl <= 30
    await tier.close()


async def test_corrupt_value_is_a_removed_miss(redis_proc: RedisProcess) -> None:
    tier = tier_for(redis_proc.url)
    s = segment(7)
    await tier.put(s.key, s)
    name = f"tierkv:default:{s.key.hex()}"
    r = redis.Redis(port=redis_proc.port)
    value = bytearray(r.get(name))
    value[-1] ^= 0xFF  # flip a payload byte: the last layer's checksum fails
    r.set(name, bytes(value))
    layers = [c.layer async for c in tier.get_layers(s.key)]
    assert layers == [0, 1]  # stops before the corrupt layer
    r.set(name, bytes(value))
    assert await tier.get(s.key) is None and not r.exists(name)
    r.set(name, b"garbage")
    assert await tier.get(s.key) is None and [c async for c in tier.get_layers(s.key)] == []
    other = segment(8)
    r.set(name, bytes(other.encode()))  # a valid segment under the wrong key
    assert await tier.get(s.key) is None
    assert tier.stats().errors == 4
    await tier.close()


async def test_redis_down_then_back(redis_proc: RedisProcess, caplog) -> None:
    tier = tier_for(redis_proc.url)
    s = segment(9)
    assert await tier.put(s.key, s)
    redis_proc.stop(kill=True)
    with caplog.at_level(logging.WARNING, logger="tierkv.redis"):
        for _ in range(20):  # never raises; misses and False
            assert await tier.get(s.key) is None
            assert await tier.contains([s.key]) == [False]
            assert not await tier.put(s.key, s)
            assert [c async for c in tier.get_layers(s.key)] == []
    down = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(down) == 1 and tier.stats().errors >= 1
    redis_proc.start()  # same port, empty (persistence off)
    assert await _eventually(lambda: tier.put(s.key, s))
    assert (await tier.get(s.key)) is not None
    await tier.close()


async def test_redis_hung_times_out(redis_proc: RedisProcess) -> None:
    tier = tier_for(redis_proc.url, timeout_s=0.5)
    s = segment(10)
    assert await tier.put(s.key, s)
    redis_proc.proc.send_signal(signal.SIGSTOP)  # accepts nothing, answers nothing
    try:
        t0 = asyncio.get_running_loop().time()
        assert await tier.get(s.key) is None
        assert await tier.contains([s.key]) == [False]  # in backoff: no wait at all
        assert asyncio.get_running_loop().time() - t0 < 1.5
    finally:
        redis_proc.proc.send_signal(signal.SIGCONT)
    assert await _eventually(lambda: tier.contains([s.key]), want=[True])
    await tier.close()


async def _eventually(fn, want=True, timeout: float = 10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await fn() == want:
            return True
        await asyncio.sleep(0.1)
    return False


async def test_refused_command_is_not_an_outage(redis_proc: RedisProcess) -> None:
    """Redis at maxmemory refuses writes: a False put, counted, but no backoff for reads."""
    tier = tier_for(redis_proc.url)
    kept, refused = segment(11), segment(12)
    assert await tier.put(kept.key, kept)
    r = redis.Redis(port=redis_proc.port)
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", r.info("memory")["used_memory"] // 2)  # already over: writes fail
    assert not await tier.put(refused.key, refused)  # OOM: refused
    assert tier.stats().errors == 1 and not tier.health.down
    assert await tier.contains([kept.key, refused.key]) == [True, False]  # reads go on at once
    assert torch.equal((await tier.get(kept.key)).payload, kept.payload)
    await tier.close()
