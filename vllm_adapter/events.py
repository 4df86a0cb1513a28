"""tierkv's tiers in vLLM's KV event channel: each entry stored in or removed from a tier is a
`BlockStored` / `BlockRemoved` beside vLLM's own GPU blocks.

Events name vLLM blocks, as vLLM's own do, so a router matching one block size (vllm-router's
`--kv-event-block-size`) reads both: a chunk is told as its full blocks of vLLM's block size
(tierkv.connector.event_blocks, shared with tierkv's engine server), each under xxh3_64(chunk
key || block index), the first one's parent the previous chunk's last block (None for a
prompt's first chunk), `token_ids` their tokens; a prompt's last, partial chunk as the blocks it
fills. A removal names every block a chunk can have. Hashes are written as vLLM writes its own
(an int by default, see block_hash). The block size is the one of vLLM's KV cache groups
(tierkv.vllm stores only models whose groups share one, tierkv.vllm.groups): every event names
a chunk of all groups' layers, so no group of its own. Where the chunk is
(tierkv.connector.placement, as vllm-router's kv_aware reads it): the worker's own tiers as
medium CPU, DISK or GPU with locality LOCAL; the shared tier as no medium, locality REMOTE and
ownership SERVER (a tierkv-server) or REDIS.

Where they come from: the worker's store reports its tiers' changes (tierkv.storage_backends'
TierChange), which ride the step's output to the scheduler (`TierKVEvents`); chunks entering
and leaving a tierkv-server come from its Watch stream, read by the scheduler (so every replica
sharing the server tells what any of them stored there: a chunk another replica stored is
named by the key this replica's hasher rebuilds from its parent and tokens, and only if that
key is the stored one's). Every queue here is bounded:
past it events are dropped and counted, never waited for.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm import envs
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierkv.connector.event_blocks import NO_PARENT, EventBlocks
from tierkv.connector.placement import SHARED, placement
from tierkv.storage_backends.keys import ChunkHasher, head_key
from tierkv.storage_backends.tier import TierChange
from tierkv.vllm.ranks import PartNames

log = logging.getLogger("tierkv.vllm")
REMOTE_TIERS = tuple(SHARED)  # the shared tier's names (the rest are the worker's own)
LOCAL_ORDER = ("gpu", "cpu", "disk")  # the worker's own tiers, fastest first
SERVER_TIER = "remote"  # a tierkv-server: its Watch stream tells what enters and leaves it


def block_hash(h: int) -> bytes | int:
    """A block's 64-bit hash as vLLM publishes its own block hashes: by default (its
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) the int, else its 8 bytes, big-endian."""
    return h if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else h.to_bytes(8, "big")


def removed(blocks: EventBlocks, chunk: bytes, tier: str) -> BlockRemoved:
    """The removal of every block chunk can have from tier."""
    return BlockRemoved([block_hash(b) for b in blocks.removed(chunk)], **placement(tier))


def hit_sources(split: dict[str, int]) -> dict[CacheHitSource, int]:
    """Tokens by tierkv tier -> by vLLM's cache-hit source (the shared tier: unspecified)."""
    kinds = {"gpu": CacheHitSource.DEVICE, "cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
    out: dict[CacheHitSource, int] = {}
    for t, n in split.items():
        k = kinds.get(t, CacheHitSource.EXTERNAL_UNSPECIFIED)
        out[k] = out.get(k, 0) + n
    return out


def to_event(c: TierChange, chunk: bytes, blocks: EventBlocks) -> KVCacheEvent | None:
    """The event of c, whose entry is chunk's head-0 part (None: a stored chunk with no full
    block)."""
    if c.kind == "removed" or c.header is None:
        return removed(blocks, chunk, c.tier)
    return stored(blocks, chunk, bytes(c.header.parent), c.header.tokens, c.tier)


def stored(blocks: EventBlocks, chunk: bytes, parent: bytes, tokens: Any, tier: str
           ) -> BlockStored | None:  # fmt: skip
    """The event of chunk (after parent, these tokens) stored in tier; None when it fills no
    block."""
    b = blocks.stored(chunk, parent, tokens)
    if b is None:
        return None
    up = None if b.parent is None else block_hash(b.parent)
    hashes, at = [block_hash(x) for x in b.hashes], placement(tier)
    return BlockStored(hashes, up, b.tokens, blocks.block_size, None, lora_name=None, **at)


@dataclass(slots=True, eq=False)
class Outbox:
    """A bounded, thread-safe queue of events (written on the connector's loop, read by vLLM's
    step); beyond `limit` new events are dropped and counted."""

    limit: int = 65536
    items: deque = field(default_factory=deque)
    dropped: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, events: list) -> None:
        with self.lock:
            room = max(0, self.limit - len(self.items))
            self.items.extend(events[:room])
            self.dropped += len(events) - min(room, len(events))

    def lost(self, n: int) -> None:
        """n events lost before they reached this box (the server's queue for this watcher)."""
        with self.lock:
            self.dropped += n

    def take(self) -> list:
        with self.lock:
            out, self.items = list(self.items), deque()
            return out


def recorder(
    box: Outbox, ns: str, blocks: EventBlocks | None, names: PartNames
) -> Callable[[TierChange], None]:
    """A TieredStore.watch hook that records ns's changes of chunks (their head-0 parts, see
    PartNames) in box as (tier, kind, chunk key, event); without blocks (vLLM's KV events
    off), only the worker's own tiers and no event (the scheduler's hit attribution needs no
    more). A tierkv-server's changes are told by its Watch stream (from_server), not here."""

    def hook(c: TierChange) -> None:
        if c.ns != ns or not (blocks or c.tier not in REMOTE_TIERS) or c.tier == SERVER_TIER:
            return
        chunk = names.chunk(c.key)
        if chunk is not None:
            event = to_event(c, chunk, blocks) if blocks else None
            box.add([(c.tier, c.kind, chunk, event)])

    return hook


class TierKVEvents(KVConnectorKVEvents):
    """A worker's events of one step, as vLLM carries them to the scheduler (and combines the
    ranks' with add_events). Items are (tier, kind, key, event)."""

    def __init__(self, items: list | None = None, workers: int = 1) -> None:
        self.items = list(items or [])
        self.workers = workers

    def add_events(self, events: list) -> None:
        self.items.extend(events)

    def aggregate(self) -> TierKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list:
        return list(self.items)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.items = []


def chunk_of(part: bytes, parent: bytes, tokens: Any, names: PartNames, hasher: ChunkHasher
             ) -> bytes | None:  # fmt: skip
    """The chunk whose head-0 part the server told stored: one this process named, else the
    key rebuilt from the parent and tokens, if its head-0 part is `part` (the same salt: another
    replica of this model, never another salt's or a tenant's cache_salt)."""
    chunk = names.chunk(part)
    if chunk is None:
        key = hasher.chunk_key(None if parent == NO_PARENT else parent, tokens)
        if head_key(key, 0) == part:
            names.note([key])
            chunk = key
    return chunk


def from_server(box: Outbox, names: PartNames, blocks: EventBlocks, hasher: ChunkHasher
                ) -> Callable[[Any], None]:  # fmt: skip
    """A Watch handler: the server's stores and removals of chunks (their head-0 parts) into
    box as events of the shared tier."""

    def handle(ev: Any) -> None:
        items = []
        for st in ev.stored:
            chunk = chunk_of(st.key, st.parent, st.tokens, names, hasher)
            e = stored(blocks, chunk, st.parent, st.tokens, SERVER_TIER) if chunk else None
            if chunk is not None and e is not None:
                items.append((SERVER_TIER, "stored", chunk, e))
        for r in ev.removed:
            chunk = names.chunk(r.key)
            if chunk is not None:
                items.append((SERVER_TIER, "removed", chunk, removed(blocks, chunk, SERVER_TIER)))
        box.add(items)
        box.lost(ev.dropped)

    return handle


@dataclass(slots=True, eq=False)
class SchedulerEvents:
    """The scheduler's side: the events to publish (when vLLM's KV events are on: the workers',
    and the server's removals) and which of the worker's own tiers hold each key (for hit
    attribution by tier; a view one step late at most, never used to decide a load)."""

    publish: bool
    box: Outbox = field(default_factory=Outbox)
    local: dict[bytes, set[str]] = field(default_factory=dict)

    def from_workers(self, ev: TierKVEvents) -> None:
        items = ev.get_all_events()
        for tier, kind, key, _ in items:
            if tier in REMOTE_TIERS:
                continue
            held = self.local.setdefault(key, set())
            if kind == "stored":
                held.add(tier)
            else:
                held.discard(tier)
                if not held:
                    del self.local[key]
        if self.publish:
            self.box.add(items)

    def take(self) -> list[KVCacheEvent]:
        return [e for *_, e in self.box.take() if e is not None]

    def tier_of(self, key: bytes, shared: str) -> str:
        """The fastest tier holding key: the worker's own, else the shared one ("server" for
        a tierkv-server)."""
        held = self.local.get(key, ())
        for t in LOCAL_ORDER:
            if t in held:
                return t
        return "server" if shared == "remote" else shared
