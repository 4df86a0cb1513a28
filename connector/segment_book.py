"""The bounded segment store: the connector's bookkeeping of the segments (parts stored for
any-position reuse) it stores, apart from the prefix KV.

A stream of novel documents must not fill the cache and push out the prefixes and segments
that hit. So a segment is admitted on its `admit_after`-th sighting (a prompt that holds it;
the first ones compute it as part of their prefill and store nothing), and the segments stored
hold at most `budget` bytes: admitting one evicts the least recently used segments first (only
segments: the prefix KV is never touched). Its bytes are the KV the connector itself stages
(tokens x the engine's per-token KV bytes), never a size a client states. The sightings of at
most `watch` keys are remembered, the oldest forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class SegmentBook:
    budget: int  # most bytes of stored segments; 0: unbounded
    admit_after: int  # sightings that store a segment (1: the first)
    watch: int  # most keys whose sightings are remembered
    sightings: OrderedDict[bytes, int] = field(default_factory=OrderedDict)  # oldest first
    stored: OrderedDict[bytes, int] = field(default_factory=OrderedDict)  # bytes, LRU first
    used: int = 0  # bytes of stored
    evicted: int = 0  # segments evicted to make room
    refused: int = 0  # segments larger than the whole budget

    def __post_init__(self) -> None:
        if self.budget < 0 or self.admit_after < 1 or self.watch < 1:
            raise ValueError(
                "segment budget must be >= 0, admit_after >= 1 and watch >= 1, got "
                f"{self.budget}, {self.admit_after}, {self.watch}"
            )

    def sight(self, key: bytes, times: int = 1) -> bool:
        """A prompt (times prompts) holding segment key: True when it is stored or now
        admitted (to be stored); a stored one becomes the most recently used."""
        if key in self.stored:
            self.stored.move_to_end(key)
            return True
        n = self.sightings.pop(key, 0) + times
        if self.admit_after > 1:  # kept one short of admission until reserve stores it
            self.sightings[key] = min(n, self.admit_after - 1)
        while len(self.sightings) > self.watch:
            self.sightings.popitem(last=False)
        return n >= self.admit_after

    def touch(self, key: bytes) -> None:
        """A stored segment was hit: the most recently used."""
        if key in self.stored:
            self.stored.move_to_end(key)

    def reserve(self, key: bytes, nbytes: int) -> list[bytes] | None:
        """Book nbytes for segment key, about to be stored: the segments evicted to make room
        (least recently used first), or None when it can never fit (nothing changed)."""
        if key in self.stored:
            self.stored.move_to_end(key)
            return []
        if self.budget and nbytes > self.budget:
            self.refused += 1
            return None
        out: list[bytes] = []
        while self.budget and self.used + nbytes > self.budget:
            old, size = self.stored.popitem(last=False)
            self.used -= size
            out.append(old)
        self.evicted += len(out)
        self.sightings.pop(key, None)
        self.stored[key] = nbytes
        self.used += nbytes
        return out

    def forget(self, key: bytes) -> None:
        """The store no longer holds segment key (its tier evicted it): its bytes are free."""
        size = self.stored.pop(key, None)
        if size is not None:
            self.used -= size

    def check_integrity(self) -> None:
        assert self.used == sum(self.stored.values()), (self.used, sum(self.stored.values()))
        assert not self.budget or self.used <= self.budget, (self.used, self.budget)
        assert all(n > 0 for n in self.stored.values())
        assert len(self.sightings) <= self.watch
        assert all(0 < n < self.admit_after for n in self.sightings.values())
        assert not set(self.sightings) & set(self.stored)
