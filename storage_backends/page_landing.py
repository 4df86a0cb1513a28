"""Writes into the cpu tier's own pages: a segment received from a socket lands where it will be
stored (the server's data plane PUT), with no buffer in between and no copy after.

Safety contract: a Landing's pages are taken from the tier's allocator as the bytes arrive
(`grow`, never for the size a client declares), evicting as a put does, and count against the
tier's capacity (as reserved) until `commit` or `abort`; they are in no index entry meanwhile,
so no reader ever sees them half-written. `commit` is called only once every layer
was checked against the header's checksums (the caller's duty: `checked` reads the pages); it
indexes the entry, or frees the pages when the key arrived meanwhile (keys name their content).
Every path ends in exactly one of the two; a tier closed meanwhile makes both a no-op."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import xxhash

from tierkv.storage_backends.pages import runs
from tierkv.storage_backends.segment import SegmentHeader


@dataclass(slots=True, eq=False)
class Landing:
    """Pages reserved in `tier` (a CpuTier) for the encoded segment of (ns, key)."""

    tier: Any
    ns: str
    key: bytes
    entry: Any  # the CpuEntry to index on commit: the header and its pages
    t0: float

    @property
    def header(self) -> SegmentHeader:
        return self.entry.header

    def grow(self, stop: int) -> bool:
        """Pages for bytes [0, stop) of the encoded segment; False (nothing taken) when the tier
        cannot make room for them."""
        t, pages = self.tier, self.entry.pages
        if self.entry not in t.landing:
            return False
        need = -(-stop // t.page_bytes) - len(pages)
        if need <= 0:
            return True
        if not t._make_room(need * t.page_bytes, self.ns):
            return False
        more = t.pages.alloc(need)
        if more is None:
            return False
        pages.extend(more)
        t.reserved_bytes += need * t.page_bytes
        return True

    def views(self, start: int, stop: int) -> list[memoryview]:
        """Writable views of bytes [start, stop) of the encoded segment, in order."""
        t, pages = self.tier, self.entry.pages
        return [t._mv[at : at + n] for at, _, n in runs(pages, t.page_bytes, start, stop)]

    def checked(self, layer: int, views: list[memoryview] | None = None) -> bool:
        """Whether the layer's bytes in the pages match the header's checksum (views: the
        layer's own, when the caller has them already)."""
        h = self.entry.header
        off, n = h.layers[layer]
        x = xxhash.xxh3_64()
        for v in self.views(off, off + n) if views is None else views:
            x.update(v)
        return bool(x.intdigest() == h.checksums[layer])

    def commit(self) -> bool:
        """Index the entry (checked by the caller); True when the tier holds the key after."""
        t = self.tier
        if not self._end():
            return False
        if t._touch(self.ns, self.key):  # stored by another put meanwhile: the same KV
            t.pages.release(self.entry.pages)
            return True
        t._add(self.ns, self.key, self.entry)
        h = self.entry.header
        t._stats.puts += 1
        t._stats.bytes_in += h.nbytes
        t._put_lat.add(time.perf_counter() - self.t0)
        t._changed("stored", self.ns, self.key, h)
        return True

    def abort(self) -> None:
        """Free the pages: the segment did not arrive whole, or failed its checks."""
        if self._end():
            self.tier.pages.release(self.entry.pages)

    def _end(self) -> bool:
        t = self.tier
        if self.entry not in t.landing:  # ended already, or the tier was closed
            return False
        t.landing.remove(self.entry)
        t.reserved_bytes -= t._entry_bytes(self.entry)
        return True


def land(tier: Any, ns: str, key: bytes, h: SegmentHeader, entry_type: type) -> Landing | None:
    """CpuTier.land: a Landing for h's encoded segment, no pages taken yet; None when the tier
    holds the key already, the segment is compressed or laid out otherwise than raw, or it can
    never fit."""
    if (ns, key) in tier.index or h.codec != "none" or h.nbytes > tier.capacity_bytes:
        return None
    n = h.layer_raw_nbytes  # laid out raw: layer i at header + i x n (no numpy on a put's path)
    if any(lay != (h.header_nbytes + i * n, n) for i, lay in enumerate(h.layers)):
        return None
    entry = entry_type(h, [])
    tier.landing.append(entry)
    return Landing(tier, ns, key, entry, time.perf_counter())
