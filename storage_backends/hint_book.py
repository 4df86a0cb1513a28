"""HintBook: what the workflow hints (storage_backends.hints) say of each cached item, for an
eviction policy to rank items by their next use.

Per namespace it keeps each workflow's latest steps-to-next-use table, the (workflow, agent)
tags of each item (a tier's key, a radix node), and soft pins. `rank(ns, item)` is the number
of steps until the item is needed next: the minimum over its tags (a prefix shared by several
agents takes the soonest), `NEVER` when untagged or when no live table names its agents, and
`PINNED` while a soft pin lasts. Evict the largest rank first; ties by recency.

Safety contract: a hint changes ranks in its own namespace only; tables and pins expire by
themselves (`ttl_s`); the book is bounded (`max_workflows` tables, `max_tags` tags per item and
`max_items` tagged or pinned items, oldest dropped first), so hints cannot grow memory without
end. An item may be tagged before it is cached (a prompt's chunks before they are saved); the
cache forgets an item when it leaves. Not thread-safe: one event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tierkv.storage_backends.hints import NEVER, KVHint
from tierkv.storage_backends.invariants import invariant

K = TypeVar("K", bound=Hashable)
PINNED = -1.0  # the rank of a soft-pinned item: kept before any hinted one
Tag = tuple[str, str]  # (workflow, agent)


@dataclass(slots=True)
class Table:
    steps: dict[str, int]
    expires: float


@dataclass(slots=True)
class HintBook(Generic[K]):
    ttl_s: float = 600.0  # a workflow's table (and a pin, by default) lasts this long
    max_workflows: int = 1024  # tables per namespace; the least recently hinted goes first
    max_tags: int = 16  # (workflow, agent) tags per item; the oldest goes first
    max_items: int = 1 << 16  # tagged items, and pinned ones; the least recently tagged go first
    tables: dict[str, OrderedDict[str, Table]] = field(default_factory=dict)
    tags: dict[tuple[str, K], list[Tag]] = field(default_factory=dict)
    pins: dict[tuple[str, K], float] = field(default_factory=dict)  # -> expiry

    def advise(self, ns: str, hint: KVHint, now: float | None = None) -> None:
        """The workflow's steps-to-next-use table becomes the hint's."""
        now = time.monotonic() if now is None else now
        book = self.tables.setdefault(ns, OrderedDict())
        book[hint.workflow] = Table(hint.steps(), now + self.ttl_s)
        book.move_to_end(hint.workflow)
        while len(book) > self.max_workflows:
            book.popitem(last=False)

    def tag(self, ns: str, item: K, hint: KVHint) -> None:
        """item holds KV of the hint's agent (its prompt, or a prefix it shares)."""
        self.add_tags(ns, item, [(hint.workflow, hint.agent)])

    def add_tags(self, ns: str, item: K, tags: list[Tag]) -> None:
        """Tag item with each of tags (a tag it has becomes its newest)."""
        ident = (ns, item)
        have = self.tags.pop(ident, [])  # re-inserted: the dict's order is the tagging order
        for t in tags:
            if t in have:
                have.remove(t)
            have.append(t)
        del have[: -self.max_tags]
        self.tags[ident] = have
        while len(self.tags) > self.max_items:
            del self.tags[next(iter(self.tags))]

    def carry(self, other: HintBook[K], ns: str, item: K) -> None:
        """Give item the tags and pin it has in other (its KV moved from other's cache)."""
        tags = other.tags.get((ns, item))
        if tags:
            self.add_tags(ns, item, tags)
        pin = other.pins.get((ns, item))
        if pin is not None:
            self.pin(ns, item, 0.0, now=pin)

    def pin(self, ns: str, item: K, ttl_s: float, now: float | None = None) -> None:
        """Keep item ahead of every hinted one for ttl_s seconds (soft: a tier that must make
        room still evicts it when nothing else is left)."""
        now = time.monotonic() if now is None else now
        self.pins.pop((ns, item), None)
        self.pins[(ns, item)] = now + ttl_s
        while len(self.pins) > self.max_items:
            del self.pins[next(iter(self.pins))]

    def forget(self, ns: str, item: K) -> None:
        """item left the cache: its tags and pin go too."""
        self.tags.pop((ns, item), None)
        self.pins.pop((ns, item), None)

    def rank(self, ns: str, item: K, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        pin = self.pins.get((ns, item))
        if pin is not None:
            if pin > now:
                return PINNED
            del self.pins[(ns, item)]
        best = NEVER
        book = self.tables.get(ns)
        for wf, agent in self.tags.get((ns, item), ()):
            table = None if book is None else book.get(wf)
            if table is None or table.expires <= now:
                continue
            best = min(best, table.steps.get(agent, NEVER))
        return best

    def check_integrity(self) -> None:
        for ns, book in self.tables.items():
            invariant(len(book) <= self.max_workflows, f"too many workflow tables in {ns!r}")
        invariant(len(self.tags) <= self.max_items, "too many tagged items")
        invariant(len(self.pins) <= self.max_items, "too many pinned items")
        for ident, tags in self.tags.items():
            invariant(0 < len(tags) <= self.max_tags, f"tags of {ident!r} out of bounds")
            invariant(len(set(tags)) == len(tags), f"a tag of {ident!r} twice")
