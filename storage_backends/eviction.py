"""Eviction policies: the order in which an indexed tier gives up entries to make room.

A policy only orders; IndexedTier._make_room decides. It hands the policy the tier's
evictable entries (unleased, not in use) in LRU order, oldest first, takes victims from the
policy's order until the put fits, and evicts them all or none. Three policies, chosen by a
tier config's `eviction` and `quotas` knobs (`make_policy`):

- `lru`: oldest first.
- `hinted`: by the tier's HintBook (storage_backends.hint_book): the largest rank (steps
  until the next use) first, untagged entries (rank NEVER) before any hinted one, soft-pinned
  ones (PINNED) last; ties by recency, oldest first.
- quotas (over either): each named namespace has a byte share of the tier; entries of
  namespaces over their share (the put's own bytes counted) go first, in the inner order,
  until each is back at its share; then the putting namespace's other entries; then the rest.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tierkv.storage_backends.hint_book import HintBook
from tierkv.storage_backends.hints import NEVER
from tierkv.storage_backends.sizes import parse_size

Ident = tuple[str, bytes]  # (namespace, key)
Candidate = tuple[Ident, int]  # an evictable entry and the bytes its eviction frees
POLICIES = ("lru", "hinted")
ANY_NS = "*"  # in quotas: the share of each namespace not named


class PolicyTier(Protocol):
    """What a policy reads of its tier."""

    hints: HintBook[bytes]
    ns_bytes: dict[str, int]
    capacity_bytes: int


class EvictionPolicy(abc.ABC):
    """Orders a tier's eviction candidates.

    Safety contract: `order` yields only entries of `candidates` (which the tier has already
    limited to unleased entries no reader holds), each at most once, and changes nothing; the
    tier evicts a prefix of the order only when that prefix frees enough bytes for the put,
    else nothing (all or nothing). A policy never evicts on its own and keeps no state of its
    entries beyond the tier's (the HintBook, ns_bytes), so check_integrity covers it there.
    """

    name: str = "policy"

    @abc.abstractmethod
    def order(
        self, tier: PolicyTier, candidates: Iterable[Candidate], ns: str, n: int
    ) -> Iterator[Candidate]:
        """candidates (LRU order, oldest first) in the order to evict them, for a put of n
        bytes into namespace ns. Both are lazy: the tier stops reading once the put fits."""


class LruPolicy(EvictionPolicy):
    name = "lru"

    def order(
        self, tier: PolicyTier, candidates: Iterable[Candidate], ns: str, n: int
    ) -> Iterator[Candidate]:
        return iter(candidates)


class HintedPolicy(EvictionPolicy):
    """KVFlow's order: the farthest next use first; recency breaks ties; no hint is LRU."""

    name = "hinted"

    def order(
        self, tier: PolicyTier, candidates: Iterable[Candidate], ns: str, n: int
    ) -> Iterator[Candidate]:
        # Entries with no live hint (rank NEVER, the most) go first in LRU order, read lazily
        # (an unhinted tier costs what LRU costs); the rest by rank, a stable sort keeping the
        # LRU order among equal ranks.
        rest: list[tuple[float, Candidate]] = []
        for c in candidates:
            r = tier.hints.rank(c[0][0], c[0][1])
            if r == NEVER:
                yield c
            else:
                rest.append((-r, c))
        rest.sort(key=lambda rc: rc[0])
        for _, c in rest:
            yield c


@dataclass(slots=True)
class QuotaPolicy(EvictionPolicy):
    """Per-namespace byte shares over an inner order. A namespace at or under its share loses
    nothing to another namespace's put while an over-share namespace has evictable entries."""

    inner: EvictionPolicy
    shares: dict[str, int] = field(default_factory=dict)  # ns -> bytes (ANY_NS: the others)
    name: str = "quota"

    def share(self, ns: str) -> int:
        return self.shares.get(ns, self.shares.get(ANY_NS, 0))

    def order(
        self, tier: PolicyTier, candidates: Iterable[Candidate], ns: str, n: int
    ) -> Iterator[Candidate]:
        inner = list(self.inner.order(tier, candidates, ns, n))
        left = dict(tier.ns_bytes)
        left[ns] = left.get(ns, 0) + n  # the put counts against its own namespace
        taken = [False] * len(inner)
        for j, (ident, nbytes) in enumerate(inner):
            if left.get(ident[0], 0) > self.share(ident[0]):
                taken[j] = True
                left[ident[0]] -= nbytes
                yield inner[j]
        for own in (True, False):  # then the putter's own entries, then everyone else's
            for j, c in enumerate(inner):
                if not taken[j] and (c[0][0] == ns) == own:
                    taken[j] = True
                    yield c


def parse_quotas(quotas: Mapping[str, int | str], capacity: int) -> dict[str, int]:
    """Quota knobs -> bytes: a size ("256MiB", 4096) or a percentage of the tier ("25%")."""
    out = {}
    for ns, q in quotas.items():
        s = str(q).strip()
        try:
            if s.endswith("%"):
                pct = float(s[:-1])
                if not 0 <= pct <= 100:
                    raise ValueError(f"{s!r} is not within 0%..100%")
                out[ns] = int(capacity * pct / 100)
            else:
                out[ns] = parse_size(q)
        except ValueError as e:
            raise ValueError(f"quotas[{ns!r}]: {e}") from None
    return out


def make_policy(
    eviction: str = "lru", quotas: Mapping[str, int | str] | None = None, capacity: int = 0
) -> EvictionPolicy:
    """The policy a tier config names; ValueError naming the knob when it is not one."""
    if eviction not in POLICIES:
        raise ValueError(f"eviction must be one of {POLICIES}, got {eviction!r}")
    inner: EvictionPolicy = HintedPolicy() if eviction == "hinted" else LruPolicy()
    if not quotas:
        return inner
    return QuotaPolicy(inner, parse_quotas(quotas, capacity))
