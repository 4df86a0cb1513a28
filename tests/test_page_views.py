"""Zero-copy reads of the cpu tier (storage_backends.page_views): random interleavings of puts,
overwrites, deletes, evicting puts and held page views never change the bytes a held view
shows, never let the tier pass its capacity, and free every page once the views end."""

from __future__ import annotations

import asyncio

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.segment import KVSegment

PAGE = 4096
CAPACITY = 24 * PAGE


def seg(k: int, version: int, T: int) -> KVSegment:
    """Key k's content, version `version` (an overwrite stores another version)."""
    g = torch.Generator().manual_seed(k * 1000 + version)
    kv = torch.randn(2, 2, T, 2, 16, generator=g).to(torch.float16)
    return KVSegment.from_tensor(kv, key=key(k), tokens=list(range(T)), fingerprint=b"f")


def key(k: int) -> bytes:
    return k.to_bytes(16, "little")


def payload(s: KVSegment) -> bytes:
    return bytes(s.payload.reshape(-1).view(torch.uint8).numpy())


OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "overwrite", "del", "view", "release"]),
        st.integers(0, 7),
        st.integers(8, 96),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, namespaces=st.booleans())
def test_held_views_keep_their_bytes_and_free_their_pages(ops, namespaces) -> None:
    async def run() -> None:
        tier = CpuTier(CpuTierConfig(capacity_bytes=CAPACITY, page_bytes=PAGE))
        version: dict[int, int] = {}
        held: list[tuple[object, bytes]] = []  # (views, the payload they showed when opened)
        for op, k, T in ops:
            ns = "b" if namespaces and k % 2 else "a"
            if op in ("put", "overwrite"):
                v = version.get(k, 0) + (op == "overwrite")
                if await tier.put(key(k), seg(k, v, T), ns):
                    version[k] = v
            elif op == "del":
                await tier.delete(key(k), ns)
            elif op == "view":
                views = tier.payload_views(key(k), ns)
                got = await tier.get(key(k), ns)
                assert (views is None) == (got is None)
                if views is not None and got is not None:
                    shown = b"".join(bytes(v) for v in views.views)
                    assert shown == payload(got) and views.nbytes == len(shown)
                    held.append((views, shown))
            elif held:
                views, _ = held.pop(k % len(held))
                views.release()  # type: ignore[attr-defined]
            for views, shown in held:  # nothing a held view shows ever changes
                assert b"".join(bytes(v) for v in views.views) == shown  # type: ignore[attr-defined]
            tier.check_integrity()
            assert tier.used_bytes + tier.reserved_bytes <= CAPACITY
            assert all(e.readers == 0 for e in tier.index.values()) or held
        for views, _ in held:
            views.release()  # type: ignore[attr-defined]
        tier.check_integrity()
        assert tier.kept == [] and tier.reserved_bytes == 0
        assert sum(len(e.pages) for e in tier.index.values()) == tier.pages.num_pages - len(
            tier.pages.free
        )

    asyncio.run(run())


def test_a_deleted_entry_under_a_reader_keeps_its_pages_until_released() -> None:
    async def run() -> None:
        tier = CpuTier(CpuTierConfig(capacity_bytes=CAPACITY, page_bytes=PAGE))
        s = seg(1, 0, 96)
        assert await tier.put(key(1), s)
        views = tier.payload_views(key(1), "default")
        assert views is not None
        before = tier.pages.num_pages - len(tier.pages.free)
        assert await tier.delete(key(1))
        assert tier.payload_views(key(1), "default") is None  # gone from the index at once
        assert tier.reserved_bytes == before * PAGE and tier.kept  # its pages still held
        views.release()
        views.release()  # twice is harmless
        assert (
            tier.reserved_bytes == 0
            and not tier.kept
            and len(tier.pages.free) == tier.pages.num_pages
        )
        tier.check_integrity()

    asyncio.run(run())
