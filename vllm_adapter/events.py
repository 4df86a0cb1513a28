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
TierChange), which ride the step's output to the scheduler (`TierKVEvents`); keys leaving a
tierkv-server come from its Watch stream, read by the scheduler. Every queue here is bounded:
past it events are dropped and counted, never waited for.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from vllm import envs
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierkv.connector.event_blocks import EventBlocks
from tierkv.connector.placement import SHARED, placement
from tierkv.storage_backends.tier import TierChange
from tierkv.vllm.ranks import PartNames

log = logging.getLogger("tierkv.vllm")
REMOTE_TIERS = tuple(SHARED)  # the shared tier's names (the rest are the worker's own)
LOCAL_ORDER = ("gpu", "cpu", "disk")  # the worker's own tiers, fastest first


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
    h = c.header
    b = blocks.stored(chunk, bytes(h.parent), h.tokens)
    if b is None:
        return None
    parent = None if b.parent is None else block_hash(b.parent)
    hashes = [block_hash(x) for x in b.hashes]
    at = placement(c.tier)
    return BlockStored(hashes, parent, b.tokens, blocks.block_size, None, lora_name=None, **at)


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
    more)."""

    def hook(c: TierChange) -> None:
        if c.ns != ns or not (blocks or c.tier not in REMOTE_TIERS):
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


async def follow_server(tier: object, box: Outbox, names: PartNames, blocks: EventBlocks) -> None:
    """Read the tierkv-server's Watch stream of this namespace into box as BlockRemoved(SERVER)
    events of the chunks whose head-0 part left (every block each can have), reconnecting with
    backoff (at most 10 s), until cancelled."""
    pause = 0.5
    while True:
        try:
            async for ev in tier.watch():  # type: ignore[attr-defined]
                pause = 0.5
                chunks = [c for c in map(names.chunk, (r.key for r in ev.removed)) if c]
                box.add([("remote", "removed", c, removed(blocks, c, "remote")) for c in chunks])
                box.lost(ev.dropped)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the server away or restarting: try again later
            if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("tierkv.vllm: the server has no Watch: no BlockRemoved(SERVER)")
                return
            log.info("tierkv.vllm: the server's Watch stream ended (%r); retrying", e)
        await asyncio.sleep(pause)
        pause = min(pause * 2, 10.0)


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
