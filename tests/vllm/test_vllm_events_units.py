"""tierkv.vllm's events and stats without an engine: a worker's store (cpu tier in front of a
real Redis) reports stores, evictions and a corrupt Redis value as vLLM events with their media,
each chunk as its vLLM-sized blocks chained to the previous chunk's, only for its namespace;
the scheduler's view attributes hits to the fastest tier; queues are bounded; latencies reach
the stats."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import msgspec
import pytest
import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from tierkv.cacheserver.launch import RedisProcess
from tierkv.connector.event_blocks import EventBlocks, chunk_blocks
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.keys import ChunkHasher, Salt, head_key
from tierkv.storage_backends.redis_tier import RedisTier, RedisTierConfig
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.store import TieredStore
from tierkv.storage_backends.tier import TierChange
from tierkv.vllm.events import (
    Outbox,
    SchedulerEvents,
    TierKVEvents,
    block_hash,
    from_server,
    recorder,
    to_event,
)
from tierkv.vllm.ranks import PartNames
from tierkv.vllm.stats import ObservedStats, Reporter, TierKVStats

T = 64  # tokens per chunk: 2 layers x 2 x 64 x 2 heads x 128 x fp32, two 256 KiB cpu pages
BLOCKS = EventBlocks(block_size=16, chunk_size=T)  # vLLM's block size: four blocks a chunk


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisProcess]:
    r = RedisProcess().start()
    yield r
    r.stop(kill=True)


def chunk(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


def seg(i: int, parent: bytes = bytes(16), head: int = 0, n: int = T) -> KVSegment:
    """KV head `head`'s part of chunk i (its parent: the previous chunk's key), n tokens."""
    kv = torch.full((2, 2, n, 2, 128), float(i))
    return KVSegment.from_tensor(
        kv,
        key=head_key(chunk(i), head),
        parent=parent,
        tokens=list(range(i * T, i * T + n)),
        fingerprint=b"f",
    )


async def test_worker_store_events_with_media(redis: RedisProcess) -> None:
    cpu = CpuTier(CpuTierConfig(capacity_bytes=1 << 20))
    store = TieredStore([cpu, RedisTier(RedisTierConfig(url=redis.url))])
    box, names = Outbox(), PartNames()
    names.note([chunk(i) for i in (0, 1, 2, 3, 4, 9)])
    store.watch(recorder(box, "team-a", BLOCKS, names))
    try:
        a, b, c = seg(0), seg(1, chunk(0)), seg(2, chunk(1))
        other_head = seg(1, chunk(0), head=1)  # a chunk is told by its head-0 part alone
        # a prompt's partial last chunk: its one full block; one with no full block: nothing
        part, tiny = seg(3, chunk(2), n=20), seg(4, chunk(3), n=10)
        for s in (a, b, other_head, c, part, tiny):
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
    events = [e for *_, e in items if e is not None]  # `tiny` has none
    # events survive vLLM's own encoding
    batch = KVEventBatch(ts=0.0, events=events)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch).events
    assert back == events
    blocks = {i: [block_hash(x) for x in chunk_blocks(chunk(i), 4)] for i in (0, 1, 2, 3, 9)}
    assert all(isinstance(x, int) for x in blocks[0])  # as vLLM's own by default
    stored = [
        (e.ownership or e.medium, tuple(e.block_hashes))
        for e in events
        if isinstance(e, BlockStored)
    ]
    want = {
        (m, tuple(blocks[i][: 1 if i == 3 else 4])) for i in (0, 1, 2, 3) for m in ("CPU", "REDIS")
    }
    assert want == set(stored) and len(stored) == len(want)  # not the head-1 part, nor `tiny`
    removed = [
        (e.ownership or e.medium, e.block_hashes) for e in events if isinstance(e, BlockRemoved)
    ]
    # a removal names every block a chunk can have
    assert ("CPU", blocks[0]) in removed  # the cpu tier (two chunks) evicted the oldest
    assert ("REDIS", blocks[0]) in removed  # the corrupt value
    assert all(len(hs) == 4 for _, hs in removed)
    sb = next(e for e in events if isinstance(e, BlockStored) and e.block_hashes == blocks[1])
    assert sb.parent_block_hash == blocks[0][-1] and sb.token_ids == list(range(T, 2 * T))
    assert sb.block_size == 16 and sb.locality == "LOCAL" and sb.ownership is None
    rb = next(e for e in events if isinstance(e, BlockStored) and e.ownership == "REDIS")
    assert rb.medium is None and rb.locality == "REMOTE"  # as vllm-router's kv_aware admits it
    first = next(e for e in events if isinstance(e, BlockStored) and e.block_hashes == blocks[0])
    assert first.parent_block_hash is None and first.token_ids == list(range(T))
    last = next(e for e in events if isinstance(e, BlockStored) and e.block_hashes == blocks[3][:1])
    assert last.parent_block_hash == blocks[2][-1] and last.token_ids == list(
        range(3 * T, 3 * T + 16)
    )
    assert not set(blocks[9]) & {x for e in events for x in e.block_hashes}

    # the scheduler: the cpu tier's keys attribute hits to "cpu", the rest to the shared tier
    sched = SchedulerEvents(publish=True)
    # what a rank sends crosses vLLM's process boundary (its executors pickle step outputs)
    sched.from_workers(pickle.loads(pickle.dumps(TierKVEvents(items))))
    assert sched.tier_of(chunk(3), "remote") == "cpu"  # by chunk key, as lookups ask
    assert sched.tier_of(chunk(0), "remote") == "server"
    assert sched.tier_of(chunk(0), "redis") == "redis"
    assert len(sched.take()) == len(events) and sched.take() == []


def test_the_servers_stores_name_chunks_this_replica_can_load() -> None:
    """The server's Watch tells head-0 parts with their parent and tokens: a chunk another
    replica stored is named by the key rebuilt here (the same salt), and chained; another
    head's part, a cache_salt tenant's chunk and a removal of an unknown part tell nothing."""
    hasher = ChunkHasher(Salt(model_fingerprint="m", kv_format="f", chunk_size=T, namespace="a"))
    tokens = list(range(1000, 1000 + 2 * T))
    keys = hasher.prefix_keys(tokens)
    tenant = hasher.salted("tenant-secret").prefix_keys(tokens)[0]

    def told(key: bytes, parent: bytes, toks: list[int]) -> pb.Stored:
        return pb.Stored(key=key, parent=parent, tokens=toks)

    ev = pb.WatchEvent(
        stored=[
            told(head_key(keys[0], 0), bytes(16), tokens[:T]),
            told(head_key(keys[1], 0), keys[0], tokens[T:]),
            told(head_key(keys[1], 1), keys[0], tokens[T:]),
            told(head_key(tenant, 0), bytes(16), tokens[:T]),
        ],
        removed=[pb.Removed(key=head_key(keys[0], 0)), pb.Removed(key=head_key(b"x" * 16, 0))],
    )
    box, names = Outbox(), PartNames()
    from_server(box, names, BLOCKS, hasher)(ev)
    items = box.take()
    assert [(t, k, c) for t, k, c, _ in items] == [
        ("remote", "stored", keys[0]),
        ("remote", "stored", keys[1]),
        ("remote", "removed", keys[0]),
    ]
    first, second, gone = (e for *_, e in items)
    assert first.block_hashes == chunk_blocks(keys[0], 4) and first.parent_block_hash is None
    assert second.parent_block_hash == first.block_hashes[-1]
    assert second.token_ids == tokens[T:] and second.ownership == "SERVER"
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == first.block_hashes


def test_block_hashes_follow_vllms_setting(monkeypatch) -> None:
    from vllm import envs

    h = chunk_blocks(bytes(range(16)), 1)[0]
    assert block_hash(h) == h  # vLLM's default: 64-bit ints
    monkeypatch.setattr(envs, "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", False, raising=False)
    assert block_hash(h) == h.to_bytes(8, "big")
    c = TierChange("removed", "remote", "team-a", chunk(0))
    assert to_event(c, chunk(0), BLOCKS).block_hashes == [
        x.to_bytes(8, "big") for x in chunk_blocks(chunk(0), 4)
    ]


def test_chunks_must_hold_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of the engine's block size"):
        EventBlocks(block_size=128, chunk_size=64)


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
