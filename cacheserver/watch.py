"""The Watch RPC's hub: keys leaving the server's store, and, for a subscriber that asks, keys
entering it (with their tokens and parent), fanned out per namespace.

Safety contract: a subscriber only ever receives changes of its own namespace (the one its
token maps to); each subscriber has a bounded queue, and a full queue drops the event and
counts it for that subscriber (reported in its next message): the store never waits for a
watcher. A key counts as gone only when no tier holds it any more (a demotion from one tier to
the next is not a removal). A key counts as stored when it enters the fastest tier (a put, or
a promotion of an entry the subscriber may already know: announcing twice is harmless).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tierkv.cacheserver.frames import too_big
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.store import TieredStore
from tierkv.storage_backends.tier import TierChange

BATCH = 512  # changes per WatchEvent at most


@dataclass(slots=True, eq=False)
class Subscriber:
    queue: asyncio.Queue[TierChange | None]  # None: the server is stopping
    stored: bool = False  # also told what is stored
    dropped: int = 0  # lost since the last message sent


@dataclass(slots=True, eq=False)
class WatchHub:
    store: TieredStore
    queue_size: int
    max_watchers: int  # open streams at once, server-wide (outside max_streams: they last)
    metrics: Any = None  # the server's Metrics (watch_dropped, watchers), if any
    subs: dict[str, set[Subscriber]] = field(default_factory=dict)  # ns -> its subscribers
    dropped: int = 0  # events lost server-wide (metrics)
    tasks: set[asyncio.Task] = field(default_factory=set)
    checking: set[tuple[str, bytes]] = field(default_factory=set)  # one check per key at once

    def __post_init__(self) -> None:
        self.store.watch(self.changed)

    def count(self) -> int:
        return sum(len(s) for s in self.subs.values())

    def changed(self, c: TierChange) -> None:
        """The store's hook (on its loop): a removal is checked against every tier first."""
        if c.ns not in self.subs:
            return
        if c.kind == "stored":
            if c.header is not None and c.tier == self.store.tiers[0].name:
                self._send(c, only_stored=True)
        elif (c.ns, c.key) not in self.checking:
            self.checking.add((c.ns, c.key))
            t = asyncio.get_running_loop().create_task(self._check(c))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

    async def _check(self, c: TierChange) -> None:
        try:
            held = (await self.store.locate([c.key], c.ns))[0] is not None
        finally:
            self.checking.discard((c.ns, c.key))
        if not held:  # else still held (a demotion, or another tier keeps a copy)
            self._send(c, only_stored=False)

    def _send(self, c: TierChange, only_stored: bool) -> None:
        for s in self.subs.get(c.ns, ()):
            if only_stored and not s.stored:
                continue
            try:
                s.queue.put_nowait(c)
            except asyncio.QueueFull:
                s.dropped += 1
                self.dropped += 1
                if self.metrics is not None:
                    self.metrics.watch_dropped.inc()

    async def stream(self, ns: str, stored: bool = False) -> AsyncIterator[bytes]:
        """Serialized WatchEvents of ns until the caller goes away (with `stored`, what enters
        the store too); BadRequest past max_watchers."""
        if self.count() >= self.max_watchers:
            raise too_big(f"{self.count()} watchers; max_watchers is {self.max_watchers}")
        sub = Subscriber(asyncio.Queue(self.queue_size), stored)
        self.subs.setdefault(ns, set()).add(sub)
        self._gauge()
        try:
            stop = False
            while not stop:
                got = [await sub.queue.get()]
                while len(got) < BATCH and not sub.queue.empty():
                    got.append(sub.queue.get_nowait())
                stop = None in got
                msg = pb.WatchEvent(dropped=sub.dropped)
                for c in got:
                    if c is None:
                        continue
                    if c.kind == "removed":
                        msg.removed.append(pb.Removed(key=c.key, reason=c.reason, tier=c.tier))
                    elif c.header is not None:
                        h = c.header
                        msg.stored.append(
                            pb.Stored(key=c.key, parent=h.parent, tokens=h.tokens.tolist())
                        )
                if msg.removed or msg.stored or sub.dropped:
                    sub.dropped = 0  # before the yield: drops while it waits go in the next
                    yield msg.SerializeToString()
        finally:
            subs = self.subs.get(ns)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self.subs[ns]
            self._gauge()

    def close(self) -> None:
        """End every stream (the server is stopping): each ends after what it has queued."""
        for subs in self.subs.values():
            for s in subs:
                if s.queue.full():
                    s.queue.get_nowait()
                    s.dropped += 1
                s.queue.put_nowait(None)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.watchers.set(self.count())
