"""The prefix cache's eviction: which unlocked leaves of the radix tree go first (the farthest
next use by the workflow hints, then the least recently used), and how many blocks could."""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.engine.radix import Node, RadixTree

NS = ""  # the engine's prefix cache is one namespace (cache_salt already splits its keys)


def evictable_blocks(tree: RadixTree) -> int:
    """Blocks in unlocked nodes (all of them can be evicted, leaves first)."""
    total, stack = 0, [tree.root]
    while stack:
        n = stack.pop()
        if n.lock_ref == 0:
            total += len(n.blocks)
        stack.extend(n.children.values())
    return total


def evict(tree: RadixTree, num_blocks: int, beyond: float | None = None) -> list[int]:
    """RadixTree.evict: up to num_blocks blocks from unlocked leaves, tail blocks first."""
    now = time.monotonic()
    heap: list[tuple[float, int, int, Node]] = []
    stack = [tree.root]
    while stack:
        n = stack.pop()
        if n.children:
            stack.extend(n.children.values())
        elif n is not tree.root and n.lock_ref == 0:
            heap.append((-tree.rank(n, now), n.last_access, id(n), n))
    heapq.heapify(heap)
    out: list[int] = []
    while heap and len(out) < num_blocks:
        if beyond is not None and -heap[0][0] <= beyond:
            break  # every leaf left is needed as soon as that, or sooner
        n = heapq.heappop(heap)[3]
        take = min(num_blocks - len(out), len(n.blocks))
        if tree.on_change is not None:
            tree.on_change("removed", tree._path(n), take)
        out += n.blocks[len(n.blocks) - take :][::-1]
        del n.blocks[len(n.blocks) - take :]
        n.key = n.key[: len(n.blocks) * tree.block_size]
        if not n.blocks:
            parent = n.parent
            assert parent is not None
            del parent.children[next(k for k, c in parent.children.items() if c is n)]
            if tree.book is not None:
                tree.book.forget(NS, n)
            if parent is not tree.root and not parent.children and parent.lock_ref == 0:
                key = (-tree.rank(parent, now), parent.last_access, id(parent), parent)
                heapq.heappush(heap, key)
    tree.num_blocks -= len(out)
    tree.stats.evicted_blocks += len(out)
    return out
