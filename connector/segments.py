"""The connector's segments (the parts stored for any-position reuse): their lookups, the
sightings that admit them and the bounded store they are booked in (segment_book.py).
Scheduler side only (the engine's thread); the deletes of evicted segments run on the loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tierkv.connector.config import ConnectorConfig
from tierkv.connector.loop import LoopThread
from tierkv.connector.plan import Chunk, ConnectorStats, RequestState
from tierkv.connector.requests import segment_keys
from tierkv.connector.segment_book import SegmentBook
from tierkv.connector.transfer import PagedKV
from tierkv.storage_backends.keys import ChunkHasher
from tierkv.storage_backends.store import TieredStore

log = logging.getLogger("tierkv.connector")


@dataclass(slots=True)
class SegmentStore:
    loop: LoopThread
    store: TieredStore
    config: ConnectorConfig
    stats: ConnectorStats
    book: SegmentBook = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        self.book = SegmentBook(int(c.segment_bytes), c.segment_admit_after, c.segment_watch)

    def lookup(
        self, hasher: ChunkHasher, segments: list[list[int]], prefix: list[int] | None
    ) -> list[bool]:
        """Whether the store holds each segment (one batched lookup; a failure is a miss)."""
        keys = segment_keys(hasher, segments, prefix)
        try:
            held = self.loop.run(
                self.store.contains(keys, self.config.namespace), self.config.lookup_timeout_s
            )
        except Exception as e:
            log.warning("connector segment lookup failed (%r): miss", e)
            return [False] * len(keys)
        for k, h in zip(keys, held):  # the book follows what the tiers evicted on their own
            if h:
                self.book.touch(k)
            else:
                self.book.forget(k)
        return list(held)

    def sight(
        self,
        hasher: ChunkHasher,
        segments: list[list[int]],
        prefix: list[int] | None,
        times: list[int] | None,
    ) -> list[bool]:
        """Each segment's sighting (times[i] prompts hold it), counted by its key: whether it
        is stored or admitted now (segment_admit_after)."""
        keys = segment_keys(hasher, segments, prefix)
        return [self.book.sight(k, t) for k, t in zip(keys, times or [1] * len(keys))]

    def book_chunk(self, st: RequestState, c: Chunk, kv: PagedKV | None) -> bool:
        """Book an ingest's chunk c before it is saved: a segment is booked in the bounded
        store by its KV bytes (this engine's layout), the least recently used segments it
        evicts deleted; False when it can never fit. A declared prefix's chunk is prefix KV."""
        if c.index < st.prefix_chunks or kv is None:
            return True
        lay = kv.layout
        per_token = lay.num_layers * 2 * lay.num_kv_heads * lay.head_dim * kv.dtype.itemsize
        evicted = self.book.reserve(c.key, (c.end - c.start) * per_token)
        if evicted is None:
            self.stats.save_dropped += 1
            return False
        for k in evicted:
            self.loop.submit(self.store.delete(k, self.config.namespace))
        return True
