"""HintBook: what the workflow hints (storage_backends.hints) say of each cached item, for an
eviction policy to rank items by their next use.

Per namespace it keeps each workflow's latest steps-to-next-use table, the (workflow, agent)
tags of each item (a tier's key, a radix node), and soft pins. `rank(ns, item)` is the number
of steps until the item is needed next: the minimum over its tags (a prefix shared by several
agents takes the soonest), `NEVER` when untagged or when no live table names its agents, and
`PINNED` while a soft pin lasts. Evict the largest rank first; ties by recency.

Held and pending: a cache that gives the book `held` (whether it holds an item) and calls
`landed` and `left` as items come and go keeps an item's tags wherever the item is. The
indexed tiers of a tiered store share one book, so a key's tags stay with the key in whichever
of them holds it, and outlive a stay in a tier that keeps no book (Redis, the cache server):
a tag of an item no cache of the book holds (tagged before it is saved, or moved to such a
tier) is *pending*, kept `pending_ttl_s` from when it became pending and applied when the
item lands again (a put, a promotion, a prefetch). Without `held` (the engine's prefix tree)
every tagged item is the cache's, and the cache forgets what leaves.

Safety contract: a hint changes ranks in its own namespace only; tables and pins expire by
themselves (`ttl_s`), pending tags too (`pending_ttl_s`); the book is bounded, so hints cannot
grow memory without end: `max_workflows` tables and, per namespace, `max_items` tagged items,
`max_items` pinned ones and `max_pending` pending ones, oldest dropped first; at most
`max_total` tagged (and pinned) items in all namespaces, past which the namespace holding the
most loses its oldest (storage_backends.ns_items): one namespace's flood of hints never drops
the tags of a namespace holding at most its share. Every drop is counted (`stats`). Not
thread-safe: one event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tierkv.storage_backends.hints import NEVER, KVHint
from tierkv.storage_backends.invariants import invariant
from tierkv.storage_backends.ns_items import NsItems

K = TypeVar("K", bound=Hashable)
PINNED = -1.0  # the rank of a soft-pinned item: kept before any hinted one
Tag = tuple[str, str]  # (workflow, agent)


@dataclass(slots=True)
class Table:
    steps: dict[str, int]
    expires: float


@dataclass(slots=True)
class BookStats:
    dropped: int = 0  # tagged or pinned items dropped by a bound (oldest first)
    expired: int = 0  # pending items whose tags expired before they landed
    applied: int = 0  # pending items whose tags applied when they landed


@dataclass(slots=True)
class HintBook(Generic[K]):
    ttl_s: float = 600.0  # a workflow's table (and a pin, by default) lasts this long
    max_workflows: int = 1024  # tables per namespace; the least recently hinted goes first
    max_tags: int = 16  # (workflow, agent) tags per item; the oldest goes first
    max_items: int = 1 << 16  # tagged items of a namespace, and pinned ones; oldest go first
    max_total: int = 1 << 18  # tagged items of all namespaces, and pinned ones
    max_pending: int = 1 << 14  # pending items of a namespace (not held); oldest go first
    pending_ttl_s: float = 600.0  # a pending tag is dropped this long after it became pending
    held: Callable[[str, K], bool] | None = None  # None: every tagged item is the cache's
    tables: dict[str, OrderedDict[str, Table]] = field(default_factory=dict)
    tags: NsItems[K, list[Tag]] = field(init=False)
    pins: NsItems[K, float] = field(init=False)  # -> expiry
    pending: NsItems[K, float] = field(init=False)  # tagged items not held -> expiry
    stats: BookStats = field(default_factory=BookStats)

    def __post_init__(self) -> None:
        self.tags = NsItems(self.max_items, self.max_total)
        self.pins = NsItems(self.max_items, self.max_total)
        self.pending = NsItems(self.max_pending, self.max_total)

    def advise(self, ns: str, hint: KVHint, now: float | None = None) -> None:
        """The workflow's steps-to-next-use table becomes the hint's."""
        now = time.monotonic() if now is None else now
        book = self.tables.setdefault(ns, OrderedDict())
        book[hint.workflow] = Table(hint.steps(), now + self.ttl_s)
        book.move_to_end(hint.workflow)
        while len(book) > self.max_workflows:
            book.popitem(last=False)

    def hint(
        self, ns: str, items: Sequence[K], hint: KVHint | None, pin_ttl_s: float = 0.0
    ) -> tuple[list[K], list[K]]:
        """Advise of hint's workflow and tag items with its agent (held or pending); soft-pin
        the held ones for pin_ttl_s (0: no pin). (items tagged, items pinned)."""
        tagged: list[K] = []
        if hint is not None:
            self.advise(ns, hint)
            for item in items:
                self.tag(ns, item, hint)
            tagged = list(items)
        if pin_ttl_s <= 0:
            return tagged, []
        held = [i for i in items if self.held is None or self.held(ns, i)]
        for item in held:
            self.pin(ns, item, pin_ttl_s)
        return tagged, held

    def tag(self, ns: str, item: K, hint: KVHint, now: float | None = None) -> None:
        """item holds KV of the hint's agent (its prompt, or a prefix it shares)."""
        self.add_tags(ns, item, [(hint.workflow, hint.agent)], now)

    def add_tags(self, ns: str, item: K, tags: list[Tag], now: float | None = None) -> None:
        """Tag item with each of tags (a tag it has becomes its newest, the item the newest
        tagged of ns); an item not held becomes pending, its expiry renewed."""
        have = list(self.tags.get(ns, item) or ())
        for t in tags:
            if t in have:
                have.remove(t)
            have.append(t)
        del have[: -self.max_tags]
        for d in self.tags.put(ns, item, have):
            self.stats.dropped += 1
            self.pending.pop(*d)
        if self.held is not None and not self.held(ns, item):
            self._pend(ns, item, time.monotonic() if now is None else now)

    def tags_of(self, ns: str, item: K) -> list[Tag]:
        return list(self.tags.get(ns, item) or ())

    def pin(self, ns: str, item: K, ttl_s: float, now: float | None = None) -> None:
        """Keep item ahead of every hinted one for ttl_s seconds (soft: a tier that must make
        room still evicts it when nothing else is left)."""
        now = time.monotonic() if now is None else now
        self.stats.dropped += len(self.pins.put(ns, item, now + ttl_s))

    def landed(self, ns: str, item: K, now: float | None = None) -> None:
        """item came into a cache of the book: its pending tags apply, unless expired."""
        expires = self.pending.pop(ns, item)
        if expires is None:
            return
        if expires <= (time.monotonic() if now is None else now):
            self.stats.expired += 1
            self.forget(ns, item)
        else:
            self.stats.applied += 1

    def left(self, ns: str, item: K, now: float | None = None) -> None:
        """item left a cache of the book (evicted, moved, unreadable): when no cache of the
        book holds it any more its tags become pending (its pin lasts until it expires)."""
        if self.held is None:
            self.forget(ns, item)
        elif (ns, item) in self.tags and not self.held(ns, item):
            self._pend(ns, item, time.monotonic() if now is None else now)

    def forget(self, ns: str, item: K) -> None:
        """item is gone (deleted): its tags, pin and pending mark go too."""
        self.tags.pop(ns, item)
        self.pins.pop(ns, item)
        self.pending.pop(ns, item)

    def _pend(self, ns: str, item: K, now: float) -> None:
        self.pending.pop(ns, item)  # re-tagged: renewed, not expired
        while (old := self.pending.oldest(ns)) is not None and old[1] <= now:
            self.stats.expired += 1
            self.forget(ns, old[0])
        for d in self.pending.put(ns, item, now + self.pending_ttl_s):
            self.stats.dropped += 1
            self.forget(*d)

    def rank(self, ns: str, item: K, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        pin = self.pins.get(ns, item)
        if pin is not None:
            if pin > now:
                return PINNED
            self.pins.pop(ns, item)
        best = NEVER
        book = self.tables.get(ns)
        for wf, agent in self.tags.get(ns, item) or ():
            table = None if book is None else book.get(wf)
            if table is None or table.expires <= now:
                continue
            best = min(best, table.steps.get(agent, NEVER))
        return best

    def counts(self, ns: str | None = None) -> dict[str, int]:
        """Tagged, pinned and pending items of ns (of every namespace when None)."""
        parts: dict[str, NsItems] = {"tagged": self.tags, "pinned": self.pins}
        parts["pending"] = self.pending
        return {k: v.size if ns is None else v.count(ns) for k, v in parts.items()}

    def items(self) -> Iterator[tuple[str, K]]:
        """Every (ns, item) tagged or pinned."""
        for ns, item, _ in self.tags.items():
            yield ns, item
        for ns, item, _ in self.pins.items():
            yield ns, item

    def check_integrity(self) -> None:
        """Bounds hold, per-namespace counts add up, and each tagged item is either held or
        pending (never both); InvariantError when not."""
        for ns, book in self.tables.items():
            invariant(len(book) <= self.max_workflows, f"too many workflow tables in {ns!r}")
        self.tags.check_integrity("tagged items")
        self.pins.check_integrity("pinned items")
        self.pending.check_integrity("pending items")
        for ns, item, tags in self.tags.items():
            invariant(0 < len(tags) <= self.max_tags, f"tags of {(ns, item)!r} out of bounds")
            invariant(len(set(tags)) == len(tags), f"a tag of {(ns, item)!r} twice")
            if self.held is not None:
                pending = (ns, item) in self.pending
                invariant(pending != self.held(ns, item), f"{(ns, item)!r}: held xor pending")
        for ns, item, _ in self.pending.items():
            invariant((ns, item) in self.tags, f"pending {(ns, item)!r} has no tags")
        invariant(self.held is not None or not self.pending.size, "pending without held")
