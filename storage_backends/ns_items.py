"""NsItems: a map of (namespace, item) -> value, bounded per namespace and in all, where one
namespace's flood never pushes out another's items while that one holds its fair share.

Items of a namespace keep their insertion order (a put of an item it has makes it the newest).
Past `per_ns` items in a namespace, that namespace's oldest goes; past `total` items in all,
the namespace holding the most loses its oldest (on a tie the namespace being added to), so
a namespace holding at most total / n items (n: namespaces holding some) loses none to the
others' puts. The HintBook keeps its tags, pins and pending tags in three of these.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tierkv.storage_backends.invariants import invariant

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(slots=True)
class NsItems(Generic[K, V]):
    per_ns: int  # items of one namespace; its oldest goes first
    total: int  # items of all namespaces; the namespace holding the most loses its oldest
    by_ns: dict[str, OrderedDict[K, V]] = field(default_factory=dict)
    size: int = 0  # items in all namespaces

    def __post_init__(self) -> None:
        if self.per_ns < 1 or self.total < 1:
            raise ValueError(f"bounds must be >= 1, got {self.per_ns}, {self.total}")

    def get(self, ns: str, item: K) -> V | None:
        d = self.by_ns.get(ns)
        return None if d is None else d.get(item)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[tuple[str, K]]:
        for ns, d in self.by_ns.items():
            for item in d:
                yield ns, item

    def __contains__(self, ident: tuple[str, K]) -> bool:
        d = self.by_ns.get(ident[0])
        return d is not None and ident[1] in d

    def count(self, ns: str) -> int:
        d = self.by_ns.get(ns)
        return 0 if d is None else len(d)

    def put(self, ns: str, item: K, value: V) -> list[tuple[str, K]]:
        """item becomes ns's newest, with value; the (ns, item)s the bounds dropped to fit it
        (never item itself: per_ns and total are at least 1)."""
        d = self.by_ns.setdefault(ns, OrderedDict())
        if item in d:
            d.move_to_end(item)
        else:
            self.size += 1
        d[item] = value
        dropped = []
        while len(d) > self.per_ns:
            dropped.append((ns, self._pop_oldest(ns)))
        while self.size > self.total:
            # O(namespaces) per drop: namespaces come from credentials, so they are few
            victim = max(
                (n for n in self.by_ns if n != ns or len(d) > 1),  # never the item put
                key=lambda n: (len(self.by_ns[n]), n == ns),
            )
            dropped.append((victim, self._pop_oldest(victim)))
        return dropped

    def pop(self, ns: str, item: K) -> V | None:
        d = self.by_ns.get(ns)
        if d is None or item not in d:
            return None
        v = d.pop(item)
        self.size -= 1
        if not d:
            del self.by_ns[ns]
        return v

    def oldest(self, ns: str) -> tuple[K, V] | None:
        d = self.by_ns.get(ns)
        return None if not d else next(iter(d.items()))

    def _pop_oldest(self, ns: str) -> K:
        d = self.by_ns[ns]
        item, _ = d.popitem(last=False)
        self.size -= 1
        if not d:
            del self.by_ns[ns]
        return item

    def items(self) -> Iterator[tuple[str, K, V]]:
        for ns, d in self.by_ns.items():
            for item, v in d.items():
                yield ns, item, v

    def check_integrity(self, what: str) -> None:
        """The per-namespace counts add up to size, and every bound holds."""
        invariant(self.size == sum(len(d) for d in self.by_ns.values()), f"{what}: size drifted")
        invariant(self.size <= self.total, f"{what}: {self.size} items > {self.total}")
        for ns, d in self.by_ns.items():
            invariant(0 < len(d) <= self.per_ns, f"{what}: {len(d)} items in {ns!r}")
