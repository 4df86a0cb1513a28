"""Tensor-parallel ranks over KV stored per KV head.

A chunk is stored as one segment per KV head of the model (`head_key(chunk_key, h)`), whatever
the writer's layout: each rank writes and reads the parts of the heads it holds, so a TP=1 and
a TP=2 deployment of the same checkpoint share every chunk, and a rank can only ever ask for
(and accept, the header's key checked) its own heads. The scheduler counts a chunk present only
when every head's part is, in one batched lookup of all parts: that is every rank's part,
without knowing the ranks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tierkv.connector.plan import Chunk, LoadPlan
from tierkv.storage_backends.keys import head_key


@dataclass(frozen=True, slots=True)
class Heads:
    """The KV heads rank `rank` of `tp` holds: [first, first + count) of the model's `total`.

    With more ranks than KV heads vLLM replicates each head over tp // total ranks
    (QKVParallelLinear: head = rank // replicas); only the first replica of a head saves it."""

    first: int
    count: int
    total: int
    saves: bool = True

    @staticmethod
    def of(rank: int, tp: int, total: int) -> Heads:
        if not (0 <= rank < tp and total >= 1):
            raise ValueError(f"bad rank {rank} of {tp} over {total} KV heads")
        if tp >= total:
            if tp % total:
                raise ValueError(f"{total} KV heads cannot be replicated over {tp} ranks")
            replicas = tp // total
            return Heads(rank // replicas, 1, total, rank % replicas == 0)
        if total % tp:
            raise ValueError(f"{total} KV heads do not split over {tp} ranks")
        n = total // tp
        return Heads(rank * n, n, total)

    def parts(self, c: Chunk) -> list[Chunk]:
        """This rank's parts of chunk c: its key replaced by each head's (the parent, the
        chain's, is the same for every part)."""
        return [
            Chunk(c.index, head_key(c.key, h), c.parent, c.start, c.end)
            for h in range(self.first, self.first + self.count)
        ]

    def plan(self, p: LoadPlan) -> LoadPlan:
        """p over this rank's parts: each chunk's parts in head order, one after another."""
        chunks = [part for c in p.chunks for part in self.parts(c)]
        tiers = [t for t in p.tiers for _ in range(self.count)]
        return LoadPlan(p.request_id, p.block_ids, p.start, p.end, chunks, tiers, p.tokens)


def heads_of(vllm_config: Any) -> int:
    """The model's KV heads, all ranks': a chunk is stored as one part per head."""
    return int(vllm_config.model_config.get_total_num_kv_heads())


def part_keys(chunks: list[Chunk], total: int) -> list[bytes]:
    """Every head's part of every chunk, chunk-major: one lookup covers all ranks."""
    return [head_key(c.key, h) for c in chunks for h in range(total)]


def chunk_tiers(where: list[int | None], total: int) -> list[int | None]:
    """Per chunk, from part_keys' answer: None unless every part is present, else the slowest
    tier (the largest index) holding one of them."""
    out: list[int | None] = []
    for i in range(0, len(where), total):
        got = where[i : i + total]
        out.append(None if any(w is None for w in got) else max(w for w in got if w is not None))
    return out


@dataclass(slots=True, eq=False)
class PartNames:
    """Which chunk each first-head part names, for the KV events: a router knows chunks, not
    parts, so a chunk is announced (stored, removed) by its head-0 part, under the chunk's own
    key. Filled from the keys this process saves, loads or looks up; bounded (the oldest go
    first); used from vLLM's thread and the connector's loop."""

    limit: int = 1 << 16
    names: OrderedDict[bytes, bytes] = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, chunk_keys: list[bytes]) -> None:
        with self.lock:
            for key in chunk_keys:
                part = head_key(key, 0)
                self.names[part] = key
                self.names.move_to_end(part)
            while len(self.names) > self.limit:
                self.names.popitem(last=False)

    def chunk(self, part: bytes) -> bytes | None:
        """The chunk whose head-0 part is `part`; None for another head's part or a part this
        process never named."""
        with self.lock:
            return self.names.get(part)
