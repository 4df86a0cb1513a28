"""A stored tier chunk as the engine blocks KV events name: routers (vllm-router's kv_aware)
match one block size, the engine's, so a chunk is told as its full blocks, never as one entry.

Block j of a chunk is xxh3_64(chunk key || u32 j, little-endian), an unsigned 64-bit int; the
first block's parent is the previous chunk's last block (a chunk's parent key names it), None
for a prompt's first chunk. Only full blocks are told: a prompt's last, partial chunk as the
blocks it fills. The block count of a chunk that left a tier is not known then, so a removal
names every block a chunk can have. Shared by tierkv's engine server and tierkv.vllm."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

NO_PARENT = bytes(16)  # a segment's parent key of a prompt's first chunk


def chunk_blocks(key: bytes, n: int) -> list[int]:
    """The hashes of a stored chunk's first n blocks."""
    return [xxhash.xxh3_64_intdigest(key + struct.pack("<I", j)) for j in range(n)]


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """A chunk's full blocks: their hashes, the parent of the first and their tokens."""

    hashes: list[int]
    parent: int | None
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class EventBlocks:
    """Chunks of chunk_size tokens told as engine blocks of block_size tokens."""

    block_size: int
    chunk_size: int

    def __post_init__(self) -> None:
        # a block astride two chunks would be told by neither
        if self.block_size <= 0 or self.chunk_size % self.block_size:
            raise ValueError(
                f"KV events need the chunk size ({self.chunk_size}) to be a multiple of the "
                f"engine's block size ({self.block_size})"
            )

    def stored(self, key: bytes, parent: bytes, tokens: np.ndarray) -> StoredBlocks | None:
        """The blocks of a chunk stored under key with these tokens (None: not one full)."""
        n = len(tokens) // self.block_size
        if not n:
            return None
        last = self.chunk_size // self.block_size - 1  # the parent chunk's last block
        up = (
            None
            if parent == NO_PARENT
            else xxhash.xxh3_64_intdigest(parent + struct.pack("<I", last))
        )
        full = [int(t) for t in tokens[: n * self.block_size]]
        return StoredBlocks(chunk_blocks(key, n), up, full)

    def removed(self, key: bytes) -> list[int]:
        """Every block a chunk stored under key can have."""
        return chunk_blocks(key, self.chunk_size // self.block_size)
