"""Workflow hints over a tiered store: `share_book` gives its indexed tiers one HintBook,
`hint_tiers` tags keys in it, and prefetch moves the KV a workflow's next step needs up the
tiers in the background.

`Prefetcher.start(keys, ns)` returns at once; a task locates the keys (one batched lookup),
reads each one held below tiers[0] from the fastest tier holding it, and puts it into every
faster tier (its tags, in the shared book, apply there). A get that arrives meanwhile reads
normally (from where the key is, promoting it as any hit does): it never waits for the
prefetch, so it is never slower than without one.

Safety contract: never blocks or fails the caller (every fault is a miss, counted); a key
already being prefetched is not read twice; at most `max_tasks` prefetches run at once,
more are dropped and counted; a delete while a prefetch runs wins (the prefetched copy is
deleted again, as a background write's is).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierkv.storage_backends.hint_book import HintBook
from tierkv.storage_backends.hints import KVHint
from tierkv.storage_backends.indexed_tier import IndexedTier
from tierkv.storage_backends.names import check_key, check_namespace
from tierkv.storage_backends.tier import Tier

if TYPE_CHECKING:
    from tierkv.storage_backends.store import TieredStore

log = logging.getLogger(__name__)


def share_book(tiers: Sequence[Tier]) -> None:
    """The indexed tiers of a store share the first one's HintBook: a key's tags and pin stay
    with the key whichever of them holds it, pending while none does (it is in Redis or on
    the cache server, or on its way between two tiers)."""
    indexed = [t for t in tiers if isinstance(t, IndexedTier)]
    if not indexed:
        return
    book = indexed[0].hints
    for t in indexed:
        t.hints = book
    book.held = lambda ns, key: any((ns, key) in t.index for t in indexed)


def book_of(tiers: Sequence[Tier]) -> HintBook[bytes] | None:
    """The HintBook the indexed tiers share (share_book); None without an indexed tier."""
    return next((t.hints for t in tiers if isinstance(t, IndexedTier)), None)


def hint_tiers(
    tiers: Sequence[Tier],
    keys: Sequence[bytes],
    ns: str,
    hint: KVHint | None,
    pin_ttl_s: float = 0.0,
) -> tuple[int, int]:
    """HintBook.hint on the book of the tiers that keep one (the others keep no hints);
    (keys tagged, keys pinned). Bad keys or namespace raise ValueError before any change."""
    check_namespace(ns)
    ks = list(dict.fromkeys(check_key(k) for k in keys))
    books = {id(t.hints): t.hints for t in tiers if isinstance(t, IndexedTier)}
    tagged: set[bytes] = set()
    pinned: set[bytes] = set()
    for book in books.values():
        a, b = book.hint(ns, ks, hint, pin_ttl_s)
        tagged.update(a)
        pinned.update(b)
    return len(tagged), len(pinned)


@dataclass(slots=True)
class PrefetchStats:
    asked: int = 0  # keys asked for
    moved: int = 0  # keys put into a faster tier
    present: int = 0  # keys already in tiers[0]
    missed: int = 0  # keys no tier held, or whose read failed
    dropped: int = 0  # keys refused: too many prefetches at once


@dataclass(slots=True, eq=False)
class Prefetcher:
    store: TieredStore
    max_tasks: int = 64  # prefetches running at once
    stats: PrefetchStats = field(default_factory=PrefetchStats)
    moving: set[tuple[str, bytes]] = field(default_factory=set)  # keys being prefetched
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    deleted: set[tuple[str, bytes]] = field(default_factory=set)  # deleted while moving

    def cancel(self, ns: str, key: bytes) -> None:
        """key was deleted: a prefetch of it running must not bring it back."""
        if (ns, key) in self.moving:
            self.deleted.add((ns, key))

    def start(self, keys: Sequence[bytes], ns: str) -> int:
        """Prefetch keys of ns in the background; how many it will look for (keys being
        prefetched already are skipped). Call on the store's event loop."""
        check_namespace(ns)
        todo = [k for k in dict.fromkeys(check_key(k) for k in keys) if (ns, k) not in self.moving]
        self.stats.asked += len(keys)
        if not todo or len(self.store.tiers) < 2:
            return 0
        if len(self.tasks) >= self.max_tasks:
            self.stats.dropped += len(todo)
            return 0
        self.moving.update((ns, k) for k in todo)
        task = asyncio.get_running_loop().create_task(self._run(todo, ns))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return len(todo)

    async def _run(self, keys: list[bytes], ns: str) -> None:
        try:
            where = await self.store.locate(keys, ns)
            for key, at in zip(keys, where):
                try:
                    await self._move(key, ns, at)
                except Exception as e:  # a tier bug must not end the others' prefetch
                    self.stats.missed += 1
                    log.warning("prefetch of %s failed: %r", key.hex(), e)
                finally:
                    self.moving.discard((ns, key))
                    self.deleted.discard((ns, key))
        except Exception as e:
            self.stats.missed += len(keys)
            log.warning("prefetch lookup failed: %r", e)
        finally:
            self.moving.difference_update((ns, k) for k in keys)
            self.deleted.difference_update((ns, k) for k in keys)

    async def _move(self, key: bytes, ns: str, at: int | None) -> None:
        if at == 0:
            self.stats.present += 1
            return
        tiers = self.store.tiers
        seg = None if at is None else await tiers[at].get(key, ns)
        if at is None or seg is None:
            self.stats.missed += 1
            return
        for faster in reversed(tiers[:at]):  # the slower first: tiers[0] last, most recent
            if (ns, key) in self.deleted:
                return
            if await faster.put(key, seg, ns):  # its tags apply there (the book is shared)
                if (ns, key) in self.deleted:  # deleted while this put ran: a delete is final
                    await faster.delete(key, ns)
        self.stats.moved += 1

    async def drain(self) -> None:
        """Wait for every prefetch running (tests, shutdown)."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
