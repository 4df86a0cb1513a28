"""tierkv.vllm's events and stats without an engine: a worker's store (cpu tier in front of a
real Redis) reports stores, evictions and a corrupt Redis value as vLLM events with their media,
chained by parent key and only for its namespace; the scheduler's view attributes hits to the
fastest tier; queues are bounded; latencies reach the stats."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import msgspec
import pytest
import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from tierkv.cacheserver.launch import RedisProcess
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.keys import head_key
from tierkv.storage_backends.redis_tier import RedisTier, RedisTierConfig
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.store import TieredStore
from tierkv.vllm.events import (
    Outbox,
    SchedulerEvents,
    TierKVEvents,
    block_hash,
    recorder,
)
from tierkv.vllm.ranks import PartNames
from tierkv.vllm.stats import ObservedStats, Reporter, TierKVStats

T = 64  # tokens per chunk: 2 layers x 2 x 64 x 2 heads x 128 x fp32, two 256 KiB cpu pages


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisProcess]:
    r = RedisProcess().start()
    yield r
    r.stop(kill=True)


def chunk(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


def seg(i: int, parent: bytes = bytes(16), head: int = 0) -> KVSegment:
    """KV head `head`'s part of chunk i (its parent: the previous chunk's key)."""
    kv = torch.full((2, 2, T, 2, 128), float(i))
    return KVSegment.from_tensor(
        kv,
        key=head_key(chunk(i), head),
        parent=parent,
        tokens=list(range(i * T, (i + 1) * T)),
        fingerprint=b"f",
    )


async def test_worker_store_events_with_media(redis: RedisProcess) -> None:
    cpu = CpuTier(CpuTierConfig(capacity_bytes=1 << 20))
    store = TieredStore([cpu, RedisTier(RedisTierConfig(url=redis.url))])
    box, names = Outbox(), PartNames()
    names.note([chunk(i) for i in (0, 1, 2, 9)])
    store.watch(recorder(box, "team-a", T, publish=True, names=names))
    try:
        a, b, c = seg(0), seg(1, chunk(0)), seg(2, chunk(1))
        other_head = seg(1, chunk(0), head=1)  # a chunk is told by its head-0 part alone
        for s in (a, b, other_head, c):
            assert await store.put(s.key, s, "team-a")
        assert await store.put(seg(9).key, seg(9), "team-b")  # another namespace: never told
        await store.drain()
        # a corrupt value in Redis: found on read, dropped, told as removed from REDIS
        name = f"tierkv:team-a:{a.key.hex()}"
        raw = bytearray(await store.tiers[1].client.get(name))
        raw[-5] ^= 1
        await store.tiers[1].client.set(name, bytes(raw))
        assert await store.tiers[1].get(a.key, "team-a") is None
    finally:
        await store.close()
    items = box.take()
    events = [e for *_, e in items]
    # events survive vLLM's own encoding
    batch = KVEventBatch(ts=0.0, events=events)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch).events
    assert back == events
    h = {s.key: block_hash(chunk(i)) for i, s in ((0, a), (1, b), (2, c), (9, seg(9)))}
    stored = [
        (e.ownership or e.medium, e.block_hashes[0]) for e in events if isinstance(e, BlockStored)
    ]
    want = {(m, h[s.key]) for s in (a, b, c) for m in ("CPU", "REDIS")}
    assert want == set(stored) and len(stored) == len(want)  # not the head-1 part
    removed = [
        (e.ownership or e.medium, e.block_hashes[0]) for e in events if isinstance(e, BlockRemoved)
    ]
    assert ("CPU", h[a.key]) in removed  # the cpu tier (two chunks) evicted the oldest
    assert ("REDIS", h[a.key]) in removed  # the corrupt value
    sb = next(e for e in events if isinstance(e, BlockStored) and e.block_hashes == [h[b.key]])
    assert sb.parent_block_hash == h[a.key] and sb.token_ids == list(range(T, 2 * T))
    assert sb.block_size == T and sb.locality == "LOCAL" and sb.ownership is None
    rb = next(e for e in events if isinstance(e, BlockStored) and e.ownership == "REDIS")
    assert rb.medium is None and rb.locality == "REMOTE"  # as vllm-router's kv_aware admits it
    first = next(e for e in events if isinstance(e, BlockStored) and e.block_hashes == [h[a.key]])
    assert first.parent_block_hash is None
    assert h[seg(9).key] not in {e.block_hashes[0] for e in events}

    # the scheduler: the cpu tier's keys attribute hits to "cpu", the rest to the shared tier
    sched = SchedulerEvents(publish=True)
    # what a rank sends crosses vLLM's process boundary (its executors pickle step outputs)
    sched.from_workers(pickle.loads(pickle.dumps(TierKVEvents(items))))
    assert sched.tier_of(chunk(2), "remote") == "cpu"  # by chunk key, as lookups ask
    assert sched.tier_of(chunk(0), "remote") == "server"
    assert sched.tier_of(chunk(0), "redis") == "redis"
    assert len(sched.take()) == len(events) and sched.take() == []


def test_block_hashes_follow_vllms_setting(monkeypatch) -> None:
    from vllm import envs

    key = bytes(range(16))
    assert block_hash(key) == int.from_bytes(key[8:], "big")  # vLLM's default: 64-bit ints
    monkeypatch.setattr(envs, "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", False, raising=False)
    assert block_hash(key) == key


def test_bounds_and_stats() -> None:
    box = Outbox(limit=3)
    box.add([1, 2])
    box.add([3, 4, 5])
    assert box.take() == [1, 2, 3] and box.dropped == 2
    st, rep = ObservedStats(), Reporter()
    st.record(st.load_seconds, 0.25)
    st.loaded_tokens += 10
    d = rep.delta(st, {"hit_tokens.cpu": 7})
    assert d is not None and d.data == {
        "loaded_tokens": 10,
        "hit_tokens.cpu": 7,
        "load_seconds": [0.25],
    }
    assert rep.delta(st, {"hit_tokens.cpu": 7}) is None  # nothing new
    total = TierKVStats({}).aggregate(d).aggregate(TierKVStats({"load_seconds": [0.5]}))
    assert total.data["load_seconds"] == [0.25, 0.5]
    assert total.reduce()["load_seconds_p50"] == 0.375
