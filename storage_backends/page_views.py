"""Zero-copy reads of the cpu tier: a segment's payload as views of the tier's own pages, for a
sender that puts them on a socket as they are (the server's TCP data port).

Safety contract: while a PageViews is held, its entry is never evicted, and a delete or an
overwrite takes the entry out of the index at once but frees its pages only when the last
reader releases them (until then they count against the tier's capacity as reserved): the
views never show another key's or another namespace's bytes. A reader must release on every
path (`with`); the views must not be used after release."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierkv.storage_backends.leases import Releasing
from tierkv.storage_backends.pages import runs
from tierkv.storage_backends.segment import SegmentHeader, checksum


@dataclass(slots=True, eq=False)
class PageViews(Releasing):
    """The payload of one stored segment (codec none: its raw bytes) as page runs."""

    tier: Any  # the CpuTier whose pages these are
    entry: Any  # its CpuEntry, read-held
    header: SegmentHeader
    views: list[memoryview] = field(default_factory=list)
    released: bool = False

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.views)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.views = []
            unread(self.tier, self.entry)


def open_views(tier: Any, ns: str, key: bytes) -> PageViews | None:
    """CpuTier.payload_views: checked as a get is, only with verify_gets (the receiver checks
    each layer); counted as a hit."""
    entry = tier.index.get((ns, key))
    if entry is None:
        tier._stats.misses += 1
        return None
    h = entry.header
    if h.codec != "none":
        return None
    pb, mv = tier.page_bytes, tier._mv
    views = [mv[at : at + n] for at, _, n in runs(entry.pages, pb, h.header_nbytes, h.nbytes)]
    if tier.config.verify_gets:
        for i, (off, n) in enumerate(h.layers):
            part = b"".join(mv[at : at + k] for at, _, k in runs(entry.pages, pb, off, off + n))
            if checksum(memoryview(part)) != h.checksums[i]:
                tier._corrupt(ns, key)
                return None
    entry.readers += 1
    tier._touch(ns, key)
    tier._stats.hits += 1
    tier._stats.bytes_out += h.payload_raw_nbytes
    return PageViews(tier, entry, h, views)


def unread(tier: Any, entry: Any) -> None:
    """A reader of entry ended: a deleted entry's pages are freed with its last reader."""
    entry.readers -= 1
    if entry.gone and not entry.readers:
        tier.kept.remove(entry)
        tier.reserved_bytes -= tier._entry_bytes(entry)
        tier.pages.release(entry.pages)
