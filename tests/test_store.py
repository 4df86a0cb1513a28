"""The tiered store: write-through in the background, promotion, demotion, full-queue drops."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.test_tiers import key, same, seg
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.disk_tier import DiskTier, DiskTierConfig
from tierkv.storage_backends.gpu_tier import GpuTier, GpuTierConfig
from tierkv.storage_backends.store import StoreConfig, TieredStore

PAYLOAD = seg(0).payload.numel() * 2  # fp16 payload bytes of one test segment


def make_store(
    tmp_path, gpu_segments: int = 3, cpu_segments: int = 6, queue: int = 64
) -> TieredStore:
    gpu = GpuTier(GpuTierConfig(capacity_bytes=gpu_segments * PAYLOAD))
    cpu = CpuTier(CpuTierConfig(capacity_bytes=cpu_segments * 4 * 4096, page_bytes=4096))
    assert -(-seg(0).nbytes // 4096) <= 4
    disk = DiskTier(DiskTierConfig(root=tmp_path / "disk", capacity_bytes="4MiB", fsync=False))
    return TieredStore([gpu, cpu, disk], StoreConfig(queue_size=queue))


async def test_write_through_and_promotion(tmp_path):
    store = make_store(tmp_path)
    gpu, cpu, disk = store.tiers
    s = seg(1)
    assert await store.put(s.key, s)
    assert await gpu.contains([s.key]) == [True]
    await store.drain()
    assert await cpu.contains([s.key]) == [True] and await disk.contains([s.key]) == [True]
    assert await store.locate([s.key, key(77)]) == [0, None]
    # only the disk has it: a get reads it there and queues its promotion into both faster
    # tiers (the get does not wait for it)
    await gpu.delete(s.key)
    await cpu.delete(s.key)
    assert await store.locate([s.key]) == [2]
    assert same(await store.get(s.key), s)
    assert store.store_stats().promoted == 1
    await store.drain()
    assert await store.locate([s.key]) == [0] and await cpu.contains([s.key]) == [True]
    layers = [c.layer async for c in store.get_layers(s.key)]
    assert layers == [0, 1]
    assert await store.get(key(77)) is None and await store.contains([key(77)]) == [False]
    assert await store.delete(s.key) and await store.contains([s.key]) == [False]
    await store.close()


async def test_caller_may_reuse_its_tensor_after_put(tmp_path):
    store = make_store(tmp_path)
    s = seg(2)
    expect = s.payload.clone()
    await store.put(s.key, s)
    s.payload.zero_()  # the engine reuses its staging buffer at once
    await store.drain()
    for tier in store.tiers:
        assert torch.equal((await tier.get(s.key)).tensor(), expect)
    await store.close()


async def test_eviction_demotes_to_the_next_tier(tmp_path):
    gpu = GpuTier(GpuTierConfig(capacity_bytes=2 * PAYLOAD))
    cpu = CpuTier(
        CpuTierConfig(capacity_bytes=4 * 4096, page_bytes=4096)
    )  # two segments of 2 pages
    disk = DiskTier(DiskTierConfig(root=tmp_path, capacity_bytes="4MiB", fsync=False))
    store = TieredStore([gpu, cpu, disk])
    # segments that only ever lived in the gpu tier (promoted copies, say)
    for i in range(2):
        assert await gpu.put(key(i), seg(i))
    for i in range(2, 6):
        assert await gpu.put(key(i), seg(i))  # evicts 0..3 in turn; each is demoted to cpu
        await store.drain()
    assert await gpu.contains([key(i) for i in range(6)]) == [False] * 4 + [True] * 2
    # cpu holds two; the two it evicted went on to disk
    assert await cpu.contains([key(i) for i in range(4)]) == [False, False, True, True]
    assert await disk.contains([key(i) for i in range(2)]) == [True, True]
    for i in range(6):
        assert same(await store.get(key(i)), seg(i))
    assert store.store_stats().demoted >= 6
    await store.drain()
    for t in store.tiers:
        t.check_integrity()
    await store.close()


async def test_full_queue_drops_and_never_blocks(tmp_path):
    store = make_store(tmp_path, gpu_segments=40, queue=2)
    segs = [seg(i) for i in range(10)]
    for s in segs:  # no await lets the worker run in between: the queue fills
        assert await store.put(s.key, s)
    st = store.store_stats()
    assert st.queued == 2 and st.dropped == 8
    await store.drain()
    gpu, cpu, disk = store.tiers
    assert sum(await disk.contains([s.key for s in segs])) == 2
    assert await gpu.contains([s.key for s in segs]) == [True] * 10
    await store.close()


async def test_slower_tier_fault_is_a_miss(tmp_path):
    store = make_store(tmp_path)
    s = seg(4)
    await store.put(s.key, s)
    await store.drain()
    gpu, cpu, disk = store.tiers
    await gpu.delete(s.key)
    await cpu.delete(s.key)
    path = disk.index[("default", s.key)].path
    path.write_bytes(b"\0" * 10)
    assert await store.get(s.key) is None
    assert disk.stats().errors == 1 and not path.exists()
    await store.close()


async def test_store_stats_and_concurrency(tmp_path):
    store = make_store(tmp_path)
    await asyncio.gather(*(store.put(key(i), seg(i)) for i in range(8)))
    got = await asyncio.gather(*(store.get(key(i % 8)) for i in range(24)))
    assert all(same(g, seg(i % 8)) for i, g in enumerate(got))
    await store.drain()
    s = store.stats()
    assert s.hits == 24 and s.num_segments >= 8
    assert [t.name for t in store.store_stats().tiers] == ["gpu", "cpu", "disk"]
    with pytest.raises(ValueError):
        await store.put(key(1), seg(2))
    await store.close()
