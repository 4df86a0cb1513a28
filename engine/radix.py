"""Radix tree over block-aligned token runs: the prefix cache's index.

Each edge holds a run of whole blocks (its key is len(blocks) * block_size tokens). The tree
knows block ids only; the BlockManager owns their reference counts (the tree holds one ref on
each block it indexes). A node is locked while a running sequence uses it; locks count up to
the root, so an unlocked node has no locked descendant and only unlocked leaves are evicted.

Eviction policy ("lru" or "hinted"): LRU takes the least recently used leaf. "hinted" keeps a
HintBook of workflow hints (storage_backends.hints): the nodes on a hinted request's path are
tagged with its (workflow, agent), and the leaf whose next use is farthest goes first (a prefix
shared by agents takes the soonest of theirs; untagged nodes count as never used again), LRU
breaking ties. Without hints both pick the same victims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tierkv.engine.invariants import invariant
from tierkv.engine.radix_evict import NS, evict, evictable_blocks
from tierkv.storage_backends.hint_book import HintBook
from tierkv.storage_backends.hints import KVHint

EVICTIONS = ("lru", "hinted")


@dataclass(slots=True, eq=False)
class Node:
    key: tuple[int, ...] = ()
    blocks: list[int] = field(default_factory=list)
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


@dataclass(slots=True)
class RadixStats:
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


# Called with ("stored" | "removed", the tokens from the root to the end of the blocks, how
# many blocks at its end came or went): observers such as KV events; it must not raise.
ChangeHook = Callable[[str, tuple[int, ...], int], None]


class RadixTree:
    def __init__(self, block_size: int, eviction: str = "lru") -> None:
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
        self.block_size = block_size
        self.root = Node()
        self.num_blocks = 0
        self.stats = RadixStats()
        self._clock = 0
        self.on_change: ChangeHook | None = None
        self.book: HintBook[Node] | None = HintBook() if eviction == "hinted" else None

    def advise(self, hint: KVHint) -> None:
        """The hint's workflow table replaces the one the tree had (a step started)."""
        if self.book is not None:
            self.book.advise(NS, hint)

    def tag(self, node: Node, hint: KVHint) -> None:
        """node and its ancestors hold KV of the hint's agent."""
        if self.book is None:
            return
        n: Node | None = node
        while n is not None and n is not self.root:
            self.book.tag(NS, n, hint)
            n = n.parent

    def rank(self, node: Node, now: float | None = None) -> float:
        """Steps until node is needed next (hinted); 0 for every node under LRU."""
        return 0.0 if self.book is None else self.book.rank(NS, node, now)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _split(self, node: Node, nblocks: int) -> Node:
        """Cut node after nblocks blocks; returns the new upper part (node becomes its child)."""
        cut = nblocks * self.block_size
        upper = Node(
            node.key[:cut], node.blocks[:nblocks], node.parent, {}, node.lock_ref, node.last_access
        )
        assert node.parent is not None
        node.parent.children[node.key[: self.block_size]] = upper
        node.key, node.blocks, node.parent = node.key[cut:], node.blocks[nblocks:], upper
        upper.children[node.key[: self.block_size]] = node
        if self.book is not None and (tags := self.book.tags_of(NS, node)):
            self.book.add_tags(NS, upper, tags)  # the upper part is a prefix of what used node
        return upper

    def _walk(self, tokens: list[int] | tuple[int, ...], split: bool) -> tuple[list[int], Node]:
        bs, n = self.block_size, len(tokens) // self.block_size
        node, blocks, i, now = self.root, [], 0, self._tick()
        node.last_access = now
        while i < n:
            child = node.children.get(tuple(tokens[i * bs : (i + 1) * bs]))
            if child is None:
                break
            k = 1  # the first block matched by the dict key
            while (
                k < len(child.blocks)
                and i + k < n
                and child.key[k * bs : (k + 1) * bs]
                == tuple(tokens[(i + k) * bs : (i + k + 1) * bs])
            ):
                k += 1
            if k < len(child.blocks):
                if not split:
                    blocks += child.blocks[:k]
                    break
                child = self._split(child, k)
            child.last_access = now
            blocks += child.blocks
            node, i = child, i + k
        return blocks, node

    def peek(self, tokens: list[int]) -> Node:
        """The deepest node whose whole run is a prefix of tokens; changes nothing (no split,
        no access time, no stats)."""
        bs, n = self.block_size, len(tokens) // self.block_size
        node, i = self.root, 0
        while i < n:
            child = node.children.get(tuple(tokens[i * bs : (i + 1) * bs]))
            k = len(child.blocks) if child is not None else 0
            if child is None or i + k > n or child.key != tuple(tokens[i * bs : (i + k) * bs]):
                break
            node, i = child, i + k
        return node

    def match(self, tokens: list[int]) -> tuple[list[int], Node]:
        """Blocks holding the longest cached block-aligned prefix of tokens, and its deepest node
        (split so that the node ends exactly at the match). The caller locks the node."""
        blocks, node = self._walk(tokens, split=True)
        self.stats.queries += 1
        self.stats.query_tokens += len(tokens) // self.block_size * self.block_size
        self.stats.hit_tokens += len(blocks) * self.block_size
        return blocks, node

    def insert(self, tokens: list[int], blocks: list[int]) -> tuple[Node, list[int]]:
        """Index blocks as the KV of tokens (len(tokens) == len(blocks) * block_size). Returns the
        deepest node and the blocks newly adopted (the caller adds the tree's ref on those);
        where the tree already holds a prefix it keeps its own blocks."""
        bs = self.block_size
        if len(tokens) != len(blocks) * bs:
            raise ValueError(f"{len(tokens)} tokens for {len(blocks)} blocks of {bs}")
        have, node = self._walk(tokens, split=True)
        rest = blocks[len(have) :]
        if not rest:
            return node, []
        child = Node(tuple(tokens[len(have) * bs :]), list(rest), node, {}, 0, self._tick())
        node.children[child.key[:bs]] = child
        self.num_blocks += len(rest)
        if self.on_change is not None:
            self.on_change("stored", tuple(tokens), len(rest))
        return child, list(rest)

    def lock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None:
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None:
            if n.lock_ref <= 0:
                raise RuntimeError("radix unlock without a matching lock")
            n.lock_ref -= 1
            n = n.parent

    def evictable_blocks(self) -> int:
        """Blocks in unlocked nodes (all of them can be evicted, leaves first)."""
        return evictable_blocks(self)

    def evict(self, num_blocks: int, beyond: float | None = None) -> list[int]:
        """Drop up to num_blocks blocks from unlocked leaves, farthest next use first (hinted),
        then least recently used, tail blocks first; with `beyond`, only leaves whose next use
        is farther than that many steps. Returns the dropped block ids (the caller releases the
        tree's refs)."""
        return evict(self, num_blocks, beyond)

    def _path(self, node: Node) -> tuple[int, ...]:
        """The tokens from the root to the end of node."""
        keys: list[tuple[int, ...]] = []
        n: Node | None = node
        while n is not None:
            keys.append(n.key)
            n = n.parent
        return tuple(t for k in reversed(keys) for t in k)

    def all_blocks(self) -> list[int]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out += n.blocks
            stack.extend(n.children.values())
        return out

    def check_integrity(self) -> None:
        bs, seen, stack = self.block_size, set(), [self.root]
        invariant(not self.root.blocks and not self.root.key, "root holds no tokens")
        while stack:
            n = stack.pop()
            invariant(len(n.key) == len(n.blocks) * bs, "key length != blocks * block_size")
            invariant(n is self.root or bool(n.blocks), "empty non-root node")
            invariant(
                n.lock_ref >= sum(c.lock_ref for c in n.children.values()), "lock below parent's"
            )
            for b in n.blocks:
                invariant(b not in seen, f"block {b} indexed twice")
                seen.add(b)
            for k, c in n.children.items():
                invariant(c.parent is n and c.key[:bs] == k, "child key or parent link broken")
                stack.append(c)
        invariant(len(seen) == self.num_blocks, "block count drifted")
        if self.book is not None:
            self.book.check_integrity()
            nodes = set(self.nodes())
            for ns, item in self.book.items():
                invariant(ns == NS and item in nodes, "hint tags for a node not in the tree")

    def nodes(self) -> list[Node]:
        """Every node but the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
