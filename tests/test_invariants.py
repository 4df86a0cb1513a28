"""The debug setting TIERKV_CHECK_INVARIANTS=1: the local tiers check their bookkeeping after
every eviction, and the engine's scheduler when its queues empty; a broken invariant raises a
named error (never an assert, which python -O would drop)."""

from __future__ import annotations

import pytest

from tests.test_scheduler import add, make, step
from tests.test_tiers import cost, key, seg
from tierkv.engine.invariants import InvariantError as EngineInvariantError
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.disk_tier import DiskTier, DiskTierConfig
from tierkv.storage_backends.gpu_tier import GpuTier, GpuTierConfig
from tierkv.storage_backends.invariants import CHECK_INVARIANTS_ENV, InvariantError
from tierkv.storage_backends.invariants import check_invariants_enabled as tiers_enabled
from tierkv.storage_backends.pages import PageAllocator


@pytest.mark.parametrize(
    "value, on", [("1", True), ("yes", True), ("", False), ("0", False), ("off", False)]
)
def test_the_setting(value: str, on: bool) -> None:
    assert tiers_enabled({CHECK_INVARIANTS_ENV: value}) is on
    assert not tiers_enabled({})


def make_tier(kind: str, tmp_path, capacity: int):
    if kind == "gpu":
        return GpuTier(GpuTierConfig(capacity_bytes=capacity))
    if kind == "cpu":
        return CpuTier(CpuTierConfig(capacity_bytes=capacity, page_bytes=4096))
    return DiskTier(DiskTierConfig(root=tmp_path / "disk", capacity_bytes=capacity, fsync=False))


@pytest.mark.parametrize("kind", ["gpu", "cpu", "disk"])
@pytest.mark.parametrize("checking", [True, False])
async def test_evictions_check_the_tier_when_set(kind, checking, tmp_path, monkeypatch) -> None:
    if checking:
        monkeypatch.setenv(CHECK_INVARIANTS_ENV, "1")
    else:
        monkeypatch.delenv(CHECK_INVARIANTS_ENV, raising=False)
    one = cost(make_tier(kind, tmp_path / "probe", 1 << 20), seg(0))
    tier = make_tier(kind, tmp_path, 2 * one + one // 2)
    assert tier.check_invariants is checking
    for i in range(3):  # the third evicts the first: checked, and sound
        assert await tier.put(key(i), seg(i))
    assert tier.stats().evictions == 1
    tier.counts["ghost"] = 1  # broken: a namespace counted that holds nothing
    with pytest.raises(InvariantError, match="namespace counts drifted"):
        tier.check_integrity()
    if checking:
        with pytest.raises(InvariantError, match="namespace counts drifted"):
            await tier.put(key(3), seg(3))  # evicts, then finds the broken count
    else:
        assert await tier.put(key(3), seg(3))  # nothing checks it
    await tier.close()


async def test_broken_byte_accounting_and_pages(tmp_path) -> None:
    tier = CpuTier(CpuTierConfig(capacity_bytes="64KiB", page_bytes=4096))
    assert await tier.put(key(1), seg(1))
    tier.check_integrity()
    tier.used_bytes += 4096
    with pytest.raises(InvariantError, match="used bytes drifted"):
        tier.check_integrity()
    tier.used_bytes -= 4096
    tier.pages.free.append(tier.pages.free[0])
    with pytest.raises(InvariantError, match="free twice"):
        tier.check_integrity()
    pages = PageAllocator(4)
    held = pages.alloc(2)
    with pytest.raises(InvariantError, match="leak"):
        pages.check_integrity([])
    pages.check_integrity([held])


@pytest.mark.parametrize("checking", [True, False])
def test_scheduler_checks_when_idle(checking, monkeypatch) -> None:
    if checking:
        monkeypatch.setenv(CHECK_INVARIANTS_ENV, "1")
    else:
        monkeypatch.delenv(CHECK_INVARIANTS_ENV, raising=False)
    s = make()
    assert s.check_invariants is checking
    add(s, 0, 12, out=2)
    while s.has_work():  # goes idle with sound bookkeeping: no error
        step(s)
    add(s, 1, 12, out=1)
    free = s.blocks.free[-1]
    s.blocks.ref[free] += 1  # broken: a free block with a reference
    out = s.schedule()
    tokens = {q.seq_id: 7 for q, smp in zip(out.seqs, out.samples()) if smp}
    if checking:
        with pytest.raises(EngineInvariantError, match="reference counts drifted"):
            s.postprocess(out, tokens, set())  # the last request finished: idle, checked
    else:
        s.postprocess(out, tokens, set())
        assert not s.has_work()
