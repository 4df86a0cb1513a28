"""A fixed-page allocator over one preallocated buffer: the cpu tier's memory manager."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tierkv.storage_backends.invariants import invariant


@dataclass(slots=True)
class PageAllocator:
    """Hands out page indices in [0, num_pages). Lowest free pages first, so a segment's pages
    tend to be contiguous and copy as a few large runs."""

    num_pages: int
    free: list[int] = field(default_factory=list)  # a min-heap
    owned: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        self.free = list(range(self.num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def alloc(self, n: int) -> list[int] | None:
        """n pages in ascending order, or None (and nothing taken) when fewer are free."""
        if n < 1 or n > len(self.free):
            return None
        pages = [heapq.heappop(self.free) for _ in range(n)]
        self.owned.update(pages)
        return pages

    def release(self, pages: Iterable[int]) -> None:
        for p in pages:
            if p not in self.owned:
                raise ValueError(f"page {p} is not allocated")
            self.owned.remove(p)
            heapq.heappush(self.free, p)

    def check_integrity(self, segments: Iterable[list[int]]) -> None:
        """Every page is either free or in exactly one segment; InvariantError if not."""
        seen: set[int] = set()
        for pages in segments:
            for p in pages:
                invariant(0 <= p < self.num_pages, f"page {p} out of range")
                invariant(p not in seen, f"page {p} is in two segments")
                seen.add(p)
        invariant(seen == self.owned, f"leak: {len(self.owned - seen)} owned pages in no segment")
        invariant(len(set(self.free)) == len(self.free), "a page is free twice")
        invariant(not seen & set(self.free), "a page is both free and in a segment")
        invariant(len(seen) + len(self.free) == self.num_pages, "pages lost")


def runs(
    pages: list[int], page_bytes: int, start: int, stop: int
) -> Iterator[tuple[int, int, int]]:
    """(buffer offset, logical offset, length) of the byte range [start, stop) of a segment laid
    over `pages`, with physically contiguous pages merged into one run."""
    pos = start
    while pos < stop:
        i, within = divmod(pos, page_bytes)
        j = i
        while j + 1 < len(pages) and pages[j + 1] == pages[j] + 1 and (j + 1) * page_bytes < stop:
            j += 1
        n = min(stop, (j + 1) * page_bytes) - pos
        yield pages[i] * page_bytes + within, pos, n
        pos += n
