"""BlockManager: owns the KV blocks (free list, reference counts, copy-on-write, prefix cache).

A block's reference count is the number of sequences whose block table holds it, plus one
when the radix tree indexes it. A block with count 0 is on the free list, and only then.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import xxhash

from tierkv.engine.invariants import invariant
from tierkv.engine.radix import Node, RadixTree
from tierkv.engine.sequence import Sequence
from tierkv.storage_backends.hints import KVHint


def tree_key(seq: Sequence, n: int) -> list[int]:
    """The prefix cache's key for seq's first n tokens."""
    return salted_key(seq.token_ids[:n], seq.params.cache_salt)


def salted_key(key: list[int], salt: str | None) -> list[int]:
    """The prefix cache's key for tokens under salt. A cache_salt replaces the first token by a
    negative number (token ids are >= 0) drawn from the salt and that token: the whole chain
    under it is then shared only by requests with the same salt."""
    if salt is not None and key:
        digest = xxhash.xxh3_64_intdigest(f"{salt}\x00{key[0]}".encode())
        key = [-1 - (digest >> 1), *key[1:]]
    return key


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        eviction: str = "lru",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"need at least one KV block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.tree = RadixTree(block_size, eviction) if enable_prefix_caching else None

    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus those only the prefix cache holds."""
        return len(self.free) + (self.tree.evictable_blocks() if self.tree else 0)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks for seq to hold KV of num_tokens tokens in all (copy-on-write included)."""
        bs = self.block_size
        need = max(0, -(-num_tokens // bs) - len(seq.block_table))
        return need + int(self._cow_index(seq, num_tokens) is not None)

    def _cow_index(self, seq: Sequence, num_tokens: int) -> int | None:
        """Index of the partly filled block that the next write would modify while it is shared."""
        i = seq.num_computed_tokens // self.block_size
        if (
            num_tokens > seq.num_computed_tokens
            and i < len(seq.block_table)
            and self.ref[seq.block_table[i]] > 1
        ):
            return i
        return None

    def _take(self, n: int) -> list[int]:
        if len(self.free) < n and self.tree is not None:
            for b in self.tree.evict(n - len(self.free)):
                self._release(b)
        if len(self.free) < n:
            raise RuntimeError("out of KV blocks (the caller checks num_available first)")
        out = [self.free.popleft() for _ in range(n)]
        for b in out:
            self.ref[b] = 1
        return out

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free.append(b)

    def match_prefix(self, seq: Sequence, limit: int | None = None) -> int:
        """Give a new sequence the cached blocks of its longest block-aligned prefix (of at most
        limit tokens) and lock them. The last prompt token is never matched: its logits must be
        computed. Returns tokens hit."""
        if self.tree is None or seq.block_table:
            return 0
        n = len(seq) - 1 if limit is None else min(len(seq) - 1, limit)
        blocks, node = self.tree.match(tree_key(seq, n))
        if seq.kv_hint is not None:
            self.tree.tag(node, seq.kv_hint)
        self.tree.lock(node)
        seq.lock = node
        for b in blocks:
            self.ref[b] += 1
        seq.block_table = list(blocks)
        seq.num_indexed_blocks = len(blocks)
        return len(blocks) * self.block_size

    def evict_beyond(self, num_blocks: int, steps: float) -> int:
        """Under "hinted" eviction, free up to num_blocks blocks of the prefix cache whose next
        use is farther than steps (farthest first); returns how many. Under LRU, none."""
        if self.tree is None or self.tree.book is None:
            return 0
        out = self.tree.evict(num_blocks, beyond=steps)
        for b in out:
            self._release(b)
        return len(out)

    def cached_tokens(self, seq: Sequence) -> int:
        """Tokens of seq's prompt (all but its last) that whole nodes of the prefix cache hold;
        changes nothing (match_prefix may find a few blocks more, inside a node)."""
        if self.tree is None:
            return 0
        n: Node | None = self.tree.peek(tree_key(seq, len(seq) - 1))
        total = 0
        while n is not None:
            total, n = total + len(n.key), n.parent
        return total

    def allocate(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]] | None:
        """Make seq's blocks cover num_tokens tokens. Returns the (src, dst) block copies to run
        before the forward (copy-on-write), or None, changing nothing, when blocks run out."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free) and need > self.num_available():
            return None
        copies = []
        cow = self._cow_index(seq, num_tokens)
        if cow is not None:
            src, (dst,) = seq.block_table[cow], self._take(1)
            seq.block_table[cow] = dst
            self._release(src)
            copies.append((src, dst))
            need -= 1
        seq.block_table += self._take(need)
        return copies

    def cache_blocks(self, seq: Sequence) -> None:
        """Offer seq's newly completed blocks (KV computed for all their tokens) to the prefix
        cache."""
        n = seq.num_computed_tokens // self.block_size
        if self.tree is None or n <= seq.num_indexed_blocks:
            return
        node, adopted = self.tree.insert(tree_key(seq, n * self.block_size), seq.block_table[:n])
        for b in adopted:
            self.ref[b] += 1
        if seq.kv_hint is not None:
            self.tree.tag(node, seq.kv_hint)
        self.tree.lock(node)
        if seq.lock is not None:
            self.tree.unlock(seq.lock)
        seq.lock, seq.num_indexed_blocks = node, n

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks; the first write into a shared partial block
        copies it."""
        child.block_table = list(parent.block_table)
        for b in child.block_table:
            self.ref[b] += 1
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_indexed_blocks = parent.num_indexed_blocks
        child.lock = parent.lock
        if child.lock is not None:
            assert self.tree is not None  # a lock is a node of the prefix cache
            self.tree.lock(child.lock)

    def free_seq(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            self._release(b)
        if seq.lock is not None:
            assert self.tree is not None  # a lock is a node of the prefix cache
            self.tree.unlock(seq.lock)
        seq.block_table, seq.lock, seq.num_indexed_blocks = [], None, 0

    def tag_prompt(self, tokens: list[int], salt: str | None, hint: KVHint) -> None:
        """The cached nodes of a prompt (as far as the tree holds it) hold hint's agent's KV:
        a workflow's table then ranks them even before that agent runs in it."""
        if self.tree is not None and self.tree.book is not None:
            node = self.tree.peek(salted_key(tokens, salt))
            if node is not self.tree.root:
                self.tree.tag(node, hint)

    def release_blocks(self, blocks: list[int]) -> None:
        """Drop refs a connector held past request_finished (see KVConnector.request_finished)."""
        for b in blocks:
            self._release(b)

    def check_integrity(self, seqs: list[Sequence], held: Iterable[list[int]] = ()) -> None:
        """held: block lists a connector still holds for finished requests."""
        count = [0] * self.num_blocks
        for s in seqs:
            invariant(
                len(s.block_table) * self.block_size >= s.num_computed_tokens, "KV beyond blocks"
            )
            for b in s.block_table:
                count[b] += 1
        for blocks in held:
            for b in blocks:
                count[b] += 1
        if self.tree is not None:
            self.tree.check_integrity()
            for b in self.tree.all_blocks():
                count[b] += 1
        invariant(count == self.ref, "reference counts drifted")
        invariant(
            sorted(self.free) == [b for b in range(self.num_blocks) if count[b] == 0],
            "free list wrong",
        )
