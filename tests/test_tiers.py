"""The gpu, cpu and disk tiers: one contract, capacity, leases, faults as misses, restarts."""

from __future__ import annotations

import asyncio
import os
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.disk_tier import DiskTier, DiskTierConfig
from tierkv.storage_backends.gpu_tier import GpuTier, GpuTierConfig
from tierkv.storage_backends.segment import KVSegment, SegmentHeader, decode_layer


def seg(i: int, T: int = 16, L: int = 2, dtype=torch.float16, codec: str = "none") -> KVSegment:
    g = torch.Generator().manual_seed(i)
    kv = torch.randn(L, 2, T, 2, 16, generator=g).to(dtype)
    return KVSegment.from_tensor(
        kv, key=i.to_bytes(16, "little"), tokens=np.arange(T) + i, fingerprint=b"fp", codec=codec
    )


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def same(a: KVSegment, b: KVSegment) -> bool:
    return a.key == b.key and torch.equal(
        a.tensor().view(torch.uint8), b.tensor().cpu().view(torch.uint8)
    )


@pytest.fixture(params=["gpu", "cpu", "disk"])
def make_tier(request, tmp_path):
    def make(capacity: int = 1 << 20):
        if request.param == "gpu":
            return GpuTier(GpuTierConfig(capacity_bytes=capacity))
        if request.param == "cpu":
            return CpuTier(CpuTierConfig(capacity_bytes=capacity, page_bytes=4096))
        return DiskTier(
            DiskTierConfig(root=tmp_path / "disk", capacity_bytes=capacity, fsync=False)
        )

    return make


async def test_contract(make_tier):
    tier = make_tier()
    segs = [seg(i, T=7 + i, codec=["none", "lz4", "shuffle+lz4"][i % 3]) for i in range(6)]
    for s in segs:
        assert await tier.put(s.key, s)
    assert await tier.contains([s.key for s in segs] + [key(99)]) == [True] * 6 + [False]
    for s in segs:
        got = await tier.get(s.key)
        assert same(got, s)
        layers = []
        async for c in tier.get_layers(s.key):  # c.data is valid until the iterator advances
            layers.append(c.layer)
            assert torch.equal(
                decode_layer(c.header, c.layer, c.data).view(torch.uint8),
                s.layer(c.layer).view(torch.uint8),
            )
        assert layers == list(range(s.num_layers))
    out = torch.empty(2, 2, 7, 2, 16, dtype=torch.float16)
    got = await tier.get(segs[0].key, out=out)
    assert torch.equal(out, segs[0].tensor()) and got.tensor().data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match="bytes"):
        await tier.get(segs[0].key, out=bytearray(10))
    assert await tier.get(key(99)) is None and [c async for c in tier.get_layers(key(99))] == []
    assert await tier.delete(segs[0].key) and not await tier.delete(segs[0].key)
    assert await tier.get(segs[0].key) is None
    st_ = tier.stats()
    assert st_.hits >= 12 and st_.misses >= 2 and st_.puts == 6 and st_.num_segments == 5
    assert st_.get_latency.count > 0 and st_.used_bytes <= st_.capacity_bytes
    tier.check_integrity()
    await tier.close()


async def test_namespaces_and_bad_input(make_tier):
    tier = make_tier()
    s = seg(1)
    assert await tier.put(s.key, s, ns="a")
    assert await tier.contains([s.key], ns="b") == [False] and await tier.get(s.key, ns="b") is None
    assert tier.count("a") == 1 and tier.count("b") == 0
    for bad in [
        lambda: tier.put(s.key, s, ns="../etc"),
        lambda: tier.get(b"short"),
        lambda: tier.put(key(2), s),
        lambda: tier.contains([b"x" * 15]),
    ]:
        with pytest.raises(ValueError):
            await bad()
    assert tier.count("a") == 1
    tier.check_integrity()


def cost(tier, s: KVSegment) -> int:
    """What one segment takes of each tier's capacity: payload, whole pages, or file bytes."""
    if isinstance(tier, GpuTier):
        return s.payload.numel() * s.payload.element_size()
    if isinstance(tier, CpuTier):
        return -(-s.nbytes // 4096) * 4096
    return s.nbytes


async def test_capacity_lru_and_leases(make_tier):
    one = cost(make_tier(), seg(0))
    tier = make_tier(capacity=4 * one + one // 2)
    evicted = []
    tier.on_evict = lambda ns, k, s: evicted.append((k, same(s, seg(int.from_bytes(k, "little")))))
    for i in range(4):
        assert await tier.put(key(i), seg(i))
    await tier.get(key(0))  # 0 is now the most recently used
    with tier.lease(key(1)):
        assert await tier.put(key(4), seg(4))  # evicts 2: LRU and unleased (1 is older but held)
    assert await tier.contains([key(i) for i in range(5)]) == [True, True, False, True, True]
    assert evicted == [(key(2), True)]
    assert tier.stats().evictions == 1
    lease = tier.lease(key(1), ttl=0.0)  # a lease ends by itself
    assert await tier.put(key(5), seg(5))
    assert (await tier.contains([key(1)])) == [False]
    lease.release()
    big = seg(7, T=4096)
    assert cost(tier, big) > 5 * one
    before = await tier.contains([key(i) for i in range(6)])
    assert not await tier.put(big.key, big)  # too large: refused, nothing evicted
    assert await tier.contains([key(i) for i in range(6)]) == before
    tier.check_integrity()


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "del", "lease"]), st.integers(0, 11), st.integers(1, 200)
        ),
        min_size=1,
        max_size=60,
    ),
    page=st.sampled_from([4096, 8192]),
)
def test_cpu_allocator_invariants(ops, page):
    async def run():
        tier = CpuTier(CpuTierConfig(capacity_bytes=16 * page, page_bytes=page))
        sizes: dict[int, int] = {}
        for op, k, T in ops:
            if op == "put":
                T = sizes.get(k, T)  # a key names its content
                ok = await tier.put(key(k), seg(k, T=T))
                if ok:
                    sizes[k] = T
                assert ok or seg(k, T=T).nbytes > 16 * page or tier.leases.active
            elif op == "get":
                got = await tier.get(key(k))
                assert got is None or same(got, seg(k, T=sizes[k]))
            elif op == "del":
                await tier.delete(key(k))
            else:
                tier.lease(key(k), ttl=0.01)
            tier.check_integrity()
            assert tier.used_bytes <= 16 * page

    asyncio.run(run())


@pytest.mark.parametrize("out", [False, True])
async def test_cpu_corrupt_memory_is_a_miss_with_verify_gets(out):
    tier = CpuTier(CpuTierConfig(capacity_bytes="64KiB", page_bytes=4096, verify_gets=True))
    for i in range(2):
        s = seg(3 + i)
        await tier.put(s.key, s)
        entry = tier.index[("default", s.key)]
        tier._buf[entry.pages[-1] * 4096 + 5] ^= 0xFF  # flip a payload byte in tier memory
        if i == 0:
            assert await tier.get(s.key, out=torch.empty_like(s.payload) if out else None) is None
        else:
            assert [c.layer async for c in tier.get_layers(s.key)] == [0]  # stops at the bad layer
        assert tier.stats().errors == i + 1 and not (await tier.contains([s.key]))[0]
    tier.check_integrity()


async def test_gpu_tier_reports_device():
    tier = GpuTier(GpuTierConfig(capacity_bytes="1MiB"))
    s = tier.stats()
    if torch.cuda.is_available():
        assert s.device.startswith("cuda")
    else:
        assert s.device == "cpu" and "no CUDA" in s.notes


async def test_concurrent_puts_and_gets(make_tier):
    # capacity for ~6 of 12 keys, so evictions race with reads; every hit must be whole and right
    tier = make_tier(capacity=6 * cost(make_tier(), seg(0, T=33)))
    rng = random.Random(0)
    errors = []

    async def worker(w: int):
        for _ in range(40):
            k = rng.randrange(12)
            if rng.random() < 0.5:
                await tier.put(key(k), seg(k, T=33))
            else:
                got = await tier.get(key(k))
                if got is not None and not same(got, seg(k, T=33)):
                    errors.append(k)
            await asyncio.sleep(0)

    await asyncio.gather(*(worker(w) for w in range(8)))
    assert not errors
    tier.check_integrity()
    # the same key from many tasks at once
    assert all(await asyncio.gather(*(tier.put(key(50), seg(50, T=33)) for _ in range(10))))
    assert tier.count() <= 6 and same(await tier.get(key(50)), seg(50, T=33))


async def test_disk_restart_recovery(tmp_path):
    cfg = DiskTierConfig(root=tmp_path, capacity_bytes="1MiB", fsync=True)
    tier = DiskTier(cfg)
    segs = [seg(i, codec="lz4" if i % 2 else "none") for i in range(5)]
    for s in segs:
        assert await tier.put(s.key, s, ns="tenant")
    await tier.close()
    d = tmp_path / "tenant"
    (d / f"{key(9).hex()}.0123abcd.tmp").write_bytes(b"half a write")
    (d / f"{key(8).hex()}.tkv").write_bytes(bytes(segs[0].encode())[:100])  # partial file
    (d / f"{key(7).hex()}.tkv").write_bytes(os.urandom(500))  # garbage
    os.replace(
        d / f"{key(4).hex()}.tkv", d / f"{key(6).hex()}.tkv"
    )  # a file under another key's name
    again = DiskTier(cfg)
    assert again.count("tenant") == 4 and again.stats().errors == 3
    assert sorted(p.name for p in d.iterdir()) == sorted(f"{key(i).hex()}.tkv" for i in range(4))
    for s in segs[:4]:
        assert same(await again.get(s.key, ns="tenant"), s)
    again.check_integrity()
    small = DiskTier(DiskTierConfig(root=tmp_path, capacity_bytes=2 * segs[0].nbytes + 100))
    assert small.count("tenant") == 2 and small.used_bytes <= small.config.capacity_bytes


@pytest.mark.parametrize("out", [False, True])
async def test_disk_corrupt_byte_is_a_miss_and_file_is_gone(tmp_path, out):
    tier = DiskTier(DiskTierConfig(root=tmp_path, capacity_bytes="1MiB", fsync=False))
    for i, codec in enumerate(["none", "lz4"]):
        s = seg(i, codec=codec)
        await tier.put(s.key, s)
        path = tier.index[("default", s.key)].path
        raw = bytearray(path.read_bytes())
        raw[SegmentHeader.decode(raw).layers[1][0] + 3] ^= 0x01
        path.write_bytes(raw)
        assert await tier.get(s.key, out=torch.empty_like(s.payload) if out else None) is None
        assert not path.exists() and not (await tier.contains([s.key]))[0]
        assert tier.stats().errors == i + 1
    s = seg(5)
    await tier.put(s.key, s)
    path = tier.index[("default", s.key)].path
    path.write_bytes(path.read_bytes()[:-10])  # truncated behind the tier's back
    assert [c async for c in tier.get_layers(s.key)][1:] == [] and not path.exists()
    tier.check_integrity()


async def test_disk_cold_read_goes_through_aiofiles(tmp_path, monkeypatch):
    import tierkv.storage_backends.disk_tier as disk_tier

    tier = DiskTier(DiskTierConfig(root=tmp_path, capacity_bytes="1MiB", fsync=True))
    s = seg(6)
    await tier.put(s.key, s)
    path = tier.index[("default", s.key)].path
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # fsynced, so the kernel can drop it
    os.close(fd)
    # Whether the pages are gone is the kernel's call (it kept them in ~25% of runs here, and a
    # probing RWF_NOWAIT read starts readahead that brings them back): the tier is told the
    # file is cold, as RWF_NOWAIT would, and must then read it through aiofiles.
    monkeypatch.setattr(disk_tier, "read_cached", lambda *a, **k: False)
    reads = []
    real = disk_tier.read_aio

    async def counted(*a, **k):
        reads.append(1)
        return await real(*a, **k)

    monkeypatch.setattr(disk_tier, "read_aio", counted)
    out = torch.empty_like(s.payload)
    assert same(await tier.get(s.key, out=out), s) and torch.equal(out, s.payload)
    assert reads == [1], "the cold read did not go through aiofiles once"


async def test_disk_write_failure_counts_and_returns_false(tmp_path):
    tier = DiskTier(DiskTierConfig(root=tmp_path, capacity_bytes="1MiB", fsync=False))
    (tmp_path / "blocked").write_text("a file where the namespace directory would go")
    s = seg(1)
    assert not await tier.put(s.key, s, ns="blocked")
    assert tier.stats().errors == 1 and tier.used_bytes == 0 and tier.count("blocked") == 0
    assert await tier.put(s.key, s)  # another namespace still works
    tier.check_integrity()
