"""The prefix cache's eviction by next use (eviction="hinted"): a hypothesis check that every
eviction takes an evictable leaf whose next use is at least as far as every other's (ties: the
least recently used), that the blocks balance and check_integrity holds; without hints the
victims are LRU's, block for block."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.engine.radix import NS, Node, RadixTree
from tierkv.storage_backends.hints import KVHint, StepGraph

BS = 2
AGENTS = ["a0", "a1", "a2", "a3", "a4"]


def path(agent: int, turn: int, shared: bool) -> list[int]:
    """An agent's prompt: maybe a prefix shared by all agents, its own system blocks, a turn."""
    head = [1, 1, 2, 2] if shared else []
    own = [t for j in range(1 + agent % 3) for t in [10 + agent * 10 + j] * BS]
    return head + own + [500 + turn] * BS


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("use"),
            st.integers(0, 4),
            st.integers(0, 3),
            st.booleans(),
            st.integers(0, 1),
            st.booleans(),
        ),
        st.tuples(
            st.just("advise"),
            st.integers(0, 1),
            st.dictionaries(st.sampled_from(AGENTS), st.integers(0, 6), min_size=1),
        ),
        st.tuples(
            st.just("graph"),
            st.integers(0, 1),
            st.lists(
                st.lists(st.sampled_from(AGENTS), min_size=1, max_size=2), min_size=1, max_size=6
            ),
            st.integers(0, 5),
            st.booleans(),
        ),
        st.tuples(st.just("evict"), st.integers(1, 4)),
        st.tuples(st.just("unlock")),
    ),
    max_size=60,
)


def leaves(t: RadixTree) -> list[Node]:
    return [n for n in t.nodes() if not n.children and n.lock_ref == 0]


def owner(t: RadixTree) -> dict[int, Node]:
    return {b: n for n in t.nodes() for b in n.blocks}


@settings(max_examples=200, deadline=None)
@given(ops)
def test_hinted_eviction_takes_the_farthest_next_use(script: list[tuple]) -> None:
    t = RadixTree(BS, "hinted")
    next_block, live, evicted, locked = 0, set(), [], []
    for op in script:
        if op[0] == "use":
            _, agent, turn, shared, wf, lock = op
            toks = path(agent, turn, shared)
            blocks = list(range(next_block, next_block + len(toks) // BS))
            next_block += len(blocks)
            node, adopted = t.insert(toks, blocks)
            live.update(adopted)
            t.tag(node, KVHint(f"w{wf}", AGENTS[agent], {AGENTS[agent]: 0}))
            if lock:
                t.lock(node)
                locked.append(node)
        elif op[0] == "advise":
            t.advise(KVHint(f"w{op[1]}", "a0", op[2]))
        elif op[0] == "graph":
            _, wf, steps, at, loop = op
            t.advise(
                KVHint(
                    f"w{wf}",
                    "a0",
                    graph=StepGraph(tuple(tuple(s) for s in steps), at % len(steps), loop),
                )
            )
        elif op[0] == "unlock":
            for n in locked:
                t.unlock(n)
            locked = []
        else:
            for _ in range(op[1]):
                cands = leaves(t)
                who = owner(t)
                got = t.evict(1)
                if not cands:
                    assert got == []
                    continue
                (b,) = got
                victim = who[b]
                key = (t.rank(victim), -victim.last_access)
                for n in cands:
                    assert key >= (t.rank(n), -n.last_access)
                live.discard(b)
                evicted.append(b)
        t.check_integrity()
        assert set(t.all_blocks()) == live and t.num_blocks == len(live)
        assert all(ns == NS for ns, _ in t.book.tags)  # type: ignore[union-attr]
    for n in locked:
        t.unlock(n)
    t.evict(10**6)
    assert t.num_blocks == 0 and not t.book.tags  # type: ignore[union-attr]
    t.check_integrity()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 3), st.booleans(), st.integers(0, 3)),
        max_size=40,
    )
)
def test_without_hints_hinted_evicts_as_lru(script: list[tuple[int, int, bool, int]]) -> None:
    lru, hinted = RadixTree(BS, "lru"), RadixTree(BS, "hinted")
    next_block = 0
    for agent, turn, shared, k in script:
        toks = path(agent, turn, shared)
        blocks = list(range(next_block, next_block + len(toks) // BS))
        next_block += len(blocks)
        for t in (lru, hinted):
            t.insert(toks, blocks)
            t.match(path((agent + 1) % 5, turn, shared))
        assert lru.evict(k) == hinted.evict(k)
    assert lru.all_blocks() == hinted.all_blocks()


def test_a_shared_prefix_ranks_by_its_soonest_agent_and_untagged_goes_first() -> None:
    t = RadixTree(BS, "hinted")
    a, _ = t.insert(path(0, 0, True), [0, 1, 2, 3])  # shared 2 blocks, a0's 1, turn 1
    b, _ = t.insert(path(1, 0, True), [4, 5, 6, 7, 8])  # a1: 2 own blocks, turn 1
    t.insert(path(2, 0, False), [9, 10, 11, 12])  # untagged: never used again as far as known
    t.tag(a, KVHint("w", "a0", {"a0": 0}))
    t.tag(b, KVHint("w", "a1", {"a1": 0}))
    t.advise(KVHint("w", "a0", {"a0": 3, "a1": 1}))
    shared = a.parent
    assert shared is not None and t.rank(shared) == 1 and t.rank(a) == 3
    assert t.evict(4) == [12, 11, 10, 9]  # the untagged leaf first, though most recent
    assert t.evict(2) == [3, 2]  # then a0's, used after a1's
    assert t.rank(shared) == 1  # the split prefix kept its tags
    assert math.isinf(t.rank(Node()))
    t.check_integrity()


def test_a_workflow_ranks_an_agents_cached_prompt_before_that_agent_runs_in_it() -> None:
    """Agents serve many workflows: workflow w2's table ranks the reviewer's prompt, cached by
    w1, through tag_prompt (a peek that changes nothing else)."""
    from tierkv.engine.block_manager import BlockManager, salted_key
    from tierkv.engine.noop_connector import NoOpConnector
    from tierkv.engine.workflow import StepPrefetch

    bm = BlockManager(64, BS, eviction="hinted")
    t = bm.tree
    assert t is not None
    rev, cod = path(3, 0, True), path(1, 0, True)
    node, _ = t.insert(rev, [0, 1, 2, 3])
    t.tag(node, KVHint("w1", "a3", {"a3": 0}))
    t.insert(cod, [4, 5, 6, 7, 8])
    before = ([n.last_access for n in t.nodes()], t.stats.queries, len(t.nodes()))
    assert t.peek(rev + [99] * BS) is node and t.peek([7] * BS) is t.root
    assert t.peek(rev[: 3 * BS]) is not node  # a node is reached only whole
    assert before == ([n.last_access for n in t.nodes()], t.stats.queries, len(t.nodes()))
    steps = StepPrefetch()
    steps.step_started(KVHint("w1", "a3", {"a3": 0}), rev)  # w1 ran the reviewer
    w2 = KVHint("w2", "a1", {"a1": 0, "a3": 1})
    assert math.isinf(t.rank(node)) or t.rank(node) == 0
    steps.start(w2, cod, None, bm, NoOpConnector(), prefetch=False)
    t.advise(KVHint("w1", "a3", {"a3": 9}))  # w1 needs it late, w2 soon: the soonest wins
    assert t.rank(node) == 1
    assert salted_key([5, 6], None) == [5, 6] and salted_key([5, 6], "s")[0] < 0
    t.check_integrity()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["run", "free", "advise"]),
            st.integers(0, 4),
            st.integers(0, 3),
            st.dictionaries(st.sampled_from(AGENTS), st.integers(0, 6), min_size=1),
        ),
        max_size=40,
    )
)
def test_block_accounting_balances_under_hinted_eviction(script: list[tuple]) -> None:
    """Sequences of hinted agents through the BlockManager of a small cache: matched, allocated
    (evicting by next use), cached and freed; reference counts and the free list always agree
    with the block tables and the tree, and the tree's book tags only nodes it holds."""
    from tierkv.engine.block_manager import BlockManager
    from tierkv.engine.sampling_params import SamplingParams
    from tierkv.engine.sequence import Sequence

    bm = BlockManager(24, BS, eviction="hinted")
    assert bm.tree is not None
    live: list[Sequence] = []
    for n, (op, agent, turn, table) in enumerate(script):
        if op == "run":
            toks = path(agent, turn, agent % 2 == 0) + [7]
            seq = Sequence(n, str(n), str(n), toks, len(toks), SamplingParams())
            seq.kv_hint = KVHint("w", AGENTS[agent], table)
            bm.tree.advise(seq.kv_hint)
            bm.match_prefix(seq)
            if bm.allocate(seq, len(seq)) is None:
                bm.free_seq(seq)  # nothing fits: it waits, holding nothing
            else:
                seq.num_computed_tokens = len(seq)
                bm.cache_blocks(seq)
                live.append(seq)
        elif op == "free" and live:
            bm.free_seq(live.pop(turn % len(live)))
        else:
            bm.tree.advise(KVHint("w", AGENTS[agent], table))
        bm.check_integrity(live)
    for s in live:
        bm.free_seq(s)
    bm.check_integrity([])
    assert bm.num_available() == bm.num_blocks
