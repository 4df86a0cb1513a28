"""Radix prefix tree: unit cases and a hypothesis model check against a dict of prefixes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.engine.radix import RadixTree

BS = 4


def toks(*blocks: int) -> list[int]:
    """One block of BS tokens per argument, all equal to it."""
    return [t for b in blocks for t in [b] * BS]


def test_match_insert_split_and_stats():
    t = RadixTree(BS)
    node, adopted = t.insert(toks(1, 2, 3), [10, 11, 12])
    assert adopted == [10, 11, 12]
    blocks, n = t.match(toks(1, 2, 9))
    assert (
        blocks == [10, 11] and n.blocks == [10, 11] and n.key == tuple(toks(1, 2))
    )  # split at 2 blocks
    assert [c.blocks for c in n.children.values()] == [[12]]
    t.check_integrity()
    _, adopted = t.insert(toks(1, 2, 7), [20, 21, 22])
    assert adopted == [22]  # the shared prefix keeps the tree's own blocks
    assert t.match(toks(1, 2, 7, 5))[0] == [10, 11, 22]
    assert t.match([1, 1, 1])[0] == []  # less than one block never matches
    assert t.stats.hit_tokens == 2 * BS + 3 * BS and t.stats.queries == 3
    t.check_integrity()


def test_insert_rejects_bad_lengths_and_changes_nothing():
    t = RadixTree(BS)
    with pytest.raises(ValueError):
        t.insert(toks(1) + [5], [1, 2])
    assert t.num_blocks == 0 and not t.root.children


def test_lru_eviction_skips_locked_and_goes_leaf_first():
    t = RadixTree(BS)
    a, _ = t.insert(toks(1, 2), [1, 2])
    b, _ = t.insert(toks(3, 4), [3, 4])
    t.lock(b)
    t.match(toks(1, 2))  # touch a: but b is locked, so a's blocks go anyway
    assert t.evict(3) == [2, 1]  # tail first; b locked
    assert t.evictable_blocks() == 0
    t.unlock(b)
    assert t.evict(1) == [4]
    t.check_integrity()
    with pytest.raises(RuntimeError):
        t.unlock(t.root)


def test_lru_order():
    t = RadixTree(BS)
    t.insert(toks(1), [1])
    t.insert(toks(2), [2])
    t.insert(toks(3), [3])
    t.match(toks(1))
    assert t.evict(2) == [2, 3]


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
        st.lists(st.integers(0, 2), min_size=1, max_size=5),
        st.integers(0, 4),
    ),
    max_size=40,
)


@settings(max_examples=80, deadline=None)
@given(ops)
def test_against_prefix_dict(script):
    t, ref, next_block, locks = RadixTree(BS), {}, [100], []
    for op, blocks, k in script:
        tokens = toks(*blocks)
        if op == "insert":
            new = list(range(next_block[0], next_block[0] + len(blocks)))
            next_block[0] += len(blocks)
            _, adopted = t.insert(tokens, new)
            for i in range(len(blocks)):
                ref.setdefault(tuple(tokens[: (i + 1) * BS]), new[i])
            assert adopted == new[len(new) - len(adopted) :]
        elif op == "match" or op == "lock":
            got, node = t.match(tokens)
            want = []
            for i in range(len(blocks)):
                if tuple(tokens[: (i + 1) * BS]) not in ref:
                    break
                want.append(ref[tuple(tokens[: (i + 1) * BS])])
            assert got == want
            if op == "lock":
                t.lock(node)
                locks.append((node, list(tokens[: len(got) * BS])))
        elif op == "unlock" and locks:
            t.unlock(locks.pop(k % len(locks))[0])
        elif op == "evict":
            protected = {
                ref[tuple(p[: (i + 1) * BS])] for _, p in locks for i in range(len(p) // BS)
            }
            gone = t.evict(k)
            assert len(gone) <= k and not protected & set(gone)
            ref = {p: b for p, b in ref.items() if b not in gone}
            # what remains is prefix-closed: evicting leaves never strands a child
            assert all(p[:-BS] in ref for p in ref if len(p) > BS)
        t.check_integrity()
        assert t.num_blocks == len(ref)
