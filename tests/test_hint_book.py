"""The HintBook's bounds and pending tags: one namespace's flood of hints never drops
another's tags (hypothesis, over the book and a real tier); tags of keys not held yet wait,
bounded and expiring, and apply when the key lands; the bookkeeping balances throughout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.storage_backends.build import ConfigError, TiersConfig, build_tiers
from tierkv.storage_backends.cpu_tier import CpuTier, CpuTierConfig
from tierkv.storage_backends.hint_book import PINNED, HintBook
from tierkv.storage_backends.hints import NEVER, KVHint
from tierkv.storage_backends.invariants import InvariantError
from tierkv.storage_backends.ns_items import NsItems
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.store import TieredStore

HINT = KVHint("w", "coder", next_use={"coder": 2})


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def segment(i: int) -> KVSegment:
    kv = torch.full((2, 2, 8, 2, 8), float(i % 97)).half()
    return KVSegment.from_tensor(kv, key=key(i), tokens=range(8), fingerprint=b"hb")


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 20), st.booleans()), max_size=200),
    st.integers(1, 6),
    st.integers(1, 12),
)
def test_ns_items_counts_balance_and_bounds_hold(ops, per_ns: int, total: int) -> None:
    m: NsItems[int, int] = NsItems(per_ns, total)
    model: dict[tuple[str, int], int] = {}
    for n, (ns, item, put) in enumerate(ops):
        if put:
            for d in m.put(ns, item, n):
                assert d != (ns, item)  # never the item put
                del model[d]
            model[(ns, item)] = n
        else:
            assert m.pop(ns, item) == model.pop((ns, item), None)
        m.check_integrity("items")
        assert {(a, b): v for a, b, v in m.items()} == model


@settings(max_examples=60, deadline=None)
@given(
    share=st.integers(1, 32),  # b's tags: at most its fair share of the total
    flood=st.lists(st.tuples(st.integers(0, 500), st.booleans()), max_size=400),
    pending=st.booleans(),  # b's keys held, or pending (not stored yet)
)
def test_a_flooding_namespace_never_drops_another_ones_tags(share, flood, pending) -> None:
    held: set[tuple[str, bytes]] = set()
    book = HintBook[bytes](
        max_items=48, max_total=64, max_pending=32, held=lambda ns, k: (ns, k) in held
    )
    b_keys = [key(i) for i in range(share)]
    if not pending:
        held.update(("b", k) for k in b_keys)
    for k in b_keys:
        book.tag("b", k, KVHint("wb", "reviewer", next_use={"reviewer": 1}), now=0.0)
        if not pending:
            book.pin("b", k, 60.0, now=0.0)
    for i, a_held in flood:  # a tags (and pins) many keys, held or not
        if a_held and ("a", key(i)) not in held:  # stored, as a tier's put tells the book
            held.add(("a", key(i)))
            book.landed("a", key(i), now=1.0)
        book.tag("a", key(i), HINT, now=1.0)
        book.pin("a", key(i), 60.0, now=1.0)
        book.check_integrity()
    assert all(book.tags_of("b", k) == [("wb", "reviewer")] for k in b_keys)
    assert all((("b", k) in book.pending) == pending for k in b_keys)
    if not pending:
        assert all(book.rank("b", k, now=2.0) == PINNED for k in b_keys)
    assert book.tags.count("a") <= 48 and book.pending.count("a") <= 32
    assert book.tags.size <= 64


async def test_a_flooding_namespace_leaves_another_ones_tags_in_a_real_tier() -> None:
    t = CpuTier(CpuTierConfig(capacity_bytes=256 * 4096, page_bytes=4096, eviction="hinted"))
    t.hints = HintBook(max_items=40, max_total=64, max_pending=16, held=t.hints.held)
    store = TieredStore([t])
    for i in range(8):
        assert await store.put(key(i), segment(i), "b")
    store.hint([key(i) for i in range(8)], "b", HINT)
    for i in range(1000, 1300):  # a: stored and not, far past every bound
        if i % 2:
            assert await store.put(key(i), segment(i), "a")
        store.hint([key(i)], "a", HINT)
    assert [t.hints.rank("b", key(i)) for i in range(8)] == [2] * 8
    assert t.hints.tags.count("a") <= 40 and t.hints.stats.dropped > 0
    store.check_integrity()
    await store.close()


async def test_pending_tags_apply_when_the_put_lands_and_expire() -> None:
    t = CpuTier(CpuTierConfig(capacity_bytes=16 * 4096, page_bytes=4096, eviction="hinted"))
    store = TieredStore([t])
    book = t.hints
    assert store.hint([key(0), key(1)], "a", HINT) == (2, 0)  # neither stored: pending
    assert ("a", key(0)) in book.pending and book.rank("a", key(0)) == 2
    store.check_integrity()
    assert await store.put(key(0), segment(0), "a")
    assert ("a", key(0)) not in book.pending and book.stats.applied == 1
    assert t.hints.rank("a", key(0)) == 2  # the hint reached the stored key
    # a pending tag older than pending_ttl_s is dropped when its key lands
    book.pending.put("a", key(1), 0.0)  # as though it became pending long ago
    assert await store.put(key(1), segment(1), "a")
    assert book.tags_of("a", key(1)) == [] and book.stats.expired == 1
    assert book.rank("a", key(1)) == NEVER
    # a delete forgets the key's tags, held or pending; a new put lands untagged
    assert await store.delete(key(0), "a")
    assert book.tags_of("a", key(0)) == []
    store.hint([key(5)], "a", HINT)
    assert not await store.delete(key(5), "a")  # not stored: its pending tags go all the same
    assert ("a", key(5)) not in book.tags and ("a", key(5)) not in book.pending
    store.check_integrity()
    await store.close()


def test_pending_tags_are_bounded_per_namespace_oldest_first() -> None:
    book = HintBook[bytes](max_pending=4, pending_ttl_s=10.0, held=lambda ns, k: False)
    for i in range(10):
        book.tag("a", key(i), HINT, now=float(i))
    assert [k for _, k, _ in book.pending.items()] == [key(i) for i in range(6, 10)]
    assert book.tags.size == 4 and book.stats.dropped == 6
    book.tag("b", key(0), HINT, now=30.0)  # a's expired tags are a's: b's hint keeps them
    assert book.pending.count("a") == 4
    book.tag("a", key(50), HINT, now=30.0)  # a's next hint sweeps a's expired ones
    assert book.pending.count("a") == 1 and book.stats.expired == 4
    book.check_integrity()


def test_check_integrity_sees_a_drifted_book() -> None:
    book = HintBook[bytes](held=lambda ns, k: False)
    book.tag("a", key(0), HINT)
    book.pending.pop("a", key(0))  # tagged, neither held nor pending
    with pytest.raises(InvariantError, match="held xor pending"):
        book.check_integrity()
    book = HintBook[bytes](held=lambda ns, k: False)
    book.tag("a", key(0), HINT)
    book.tags.size += 1
    with pytest.raises(InvariantError, match="size drifted"):
        book.check_integrity()


def test_the_hint_book_knobs(tmp_path) -> None:
    c = TiersConfig(
        cpu_bytes="1MiB",
        disk_dir=tmp_path,
        disk_bytes="1MiB",
        hint_keys=100,
        hint_keys_total=300,
        hint_pending=10,
        hint_pending_s=5.0,
    )
    cpu, disk = build_tiers(c)
    assert cpu.hints is disk.hints  # type: ignore[attr-defined]
    book = cpu.hints  # type: ignore[attr-defined]
    assert (book.max_items, book.max_total, book.max_pending, book.pending_ttl_s) == (
        100,
        300,
        10,
        5.0,
    )
    for bad in ({"hint_keys": 0}, {"hint_pending": 0}, {"hint_pending_s": 0.0}):
        with pytest.raises(ConfigError, match="hint_"):
            TiersConfig(**bad)  # type: ignore[arg-type]
