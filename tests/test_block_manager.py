"""BlockManager: reference counts, copy-on-write, prefix reuse, capacity (unit + hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.engine.block_manager import BlockManager
from tierkv.engine.sampling_params import SamplingParams
from tierkv.engine.sequence import Sequence

BS = 4


def seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, str(i), str(i), list(tokens), len(tokens), SamplingParams())


def test_prefix_reuse_refcounts_and_last_token_recomputed():
    bm = BlockManager(8, BS)
    a = seq(0, list(range(8)))
    assert bm.match_prefix(a) == 0 and bm.allocate(a, 8) == []
    a.num_computed_tokens = 8
    bm.cache_blocks(a)
    b = seq(1, list(range(8)))
    assert bm.match_prefix(b) == BS  # 8 tokens: the second block holds the last token, recomputed
    assert b.block_table == a.block_table[:1] and bm.ref[a.block_table[0]] == 3  # a, b, tree
    bm.check_integrity([a, b])
    bm.free_seq(a)
    bm.free_seq(b)
    bm.check_integrity([])
    assert len(bm.free) == 6 and bm.num_available() == 8  # two cached blocks, evictable


def test_copy_on_write_for_a_shared_partial_block():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    p = seq(0, list(range(6)))
    bm.allocate(p, 6)
    p.num_computed_tokens = 6
    c = seq(1, list(range(6)))
    bm.fork(p, c)
    assert bm.ref[p.block_table[1]] == 2
    copies = bm.allocate(c, 7)  # writes into the shared half-full block
    assert (
        len(copies) == 1 and copies[0][0] == p.block_table[1] and c.block_table[1] == copies[0][1]
    )
    assert c.block_table[0] == p.block_table[0] and bm.ref[p.block_table[0]] == 2
    assert bm.allocate(p, 7) == []  # p is now the only owner of its block
    bm.check_integrity([p, c])


def test_allocation_failure_changes_nothing():
    bm = BlockManager(3, BS)
    a = seq(0, list(range(10)))
    bm.allocate(a, 10)
    b = seq(1, list(range(50, 60)))
    before = (list(bm.ref), list(bm.free), list(b.block_table))
    assert bm.allocate(b, 10) is None
    assert (list(bm.ref), list(bm.free), list(b.block_table)) == before
    bm.check_integrity([a])


ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "grow", "fork", "free"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 1), min_size=1, max_size=12),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 12), st.booleans(), ops)
def test_random_workload_keeps_invariants(num_blocks, prefix, script):
    bm, live, next_id = BlockManager(num_blocks, BS, prefix), [], [0]
    for op, k, tokens in script:
        if op == "new":
            s = seq(next_id[0], tokens)
            next_id[0] += 1
            hit = bm.match_prefix(s)
            assert hit % BS == 0 and hit < len(tokens)
            s.num_computed_tokens = hit
            if bm.allocate(s, len(tokens)) is None:
                bm.free_seq(s)
            else:
                s.num_computed_tokens = len(tokens)
                bm.cache_blocks(s)
                live.append(s)
        elif op == "grow" and live:
            s = live[k % len(live)]
            s.token_ids += tokens
            if bm.allocate(s, len(s)) is not None:
                s.num_computed_tokens = len(s)
                bm.cache_blocks(s)
            else:
                del s.token_ids[s.num_computed_tokens :]
        elif op == "fork" and live:
            p = live[k % len(live)]
            c = seq(next_id[0], p.token_ids)
            next_id[0] += 1
            bm.fork(p, c)
            live.append(c)
        elif op == "free" and live:
            bm.free_seq(live.pop(k % len(live)))
        bm.check_integrity(live)
        for s in live:  # every computed token has a slot, and a block is never beyond capacity
            assert len(s.block_table) * BS >= s.num_computed_tokens
            assert all(0 <= b < num_blocks for b in s.block_table)
    for s in live:
        bm.free_seq(s)
    bm.check_integrity([])
    assert bm.num_available() == num_blocks
