"""The cpu tier: encoded segments laid over fixed pages of one preallocated host buffer."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from tierkv.storage_backends.base import (
    DEFAULT_NAMESPACE,
    IndexedTier,
    Latency,
    LayerChunk,
    Leases,
    TierStats,
    check_key,
    check_namespace,
    parse_size,
)
from tierkv.storage_backends.buffers import copy_into, out_view
from tierkv.storage_backends.pages import PageAllocator, runs
from tierkv.storage_backends.segment import (
    KVSegment,
    SegmentError,
    SegmentHeader,
    checksum,
    decode_layer,
)


@dataclass(slots=True)
class CpuTierConfig:
    capacity_bytes: int | str = "1GiB"  # the whole buffer, allocated once at start; never exceeded
    page_bytes: int | str = (
        "256KiB"  # allocation unit; a segment wastes at most one page less a byte
    )
    pin_memory: bool | None = (
        None  # page-lock the buffer for fast H2D copies; None: when CUDA is present
    )
    lease_ttl_s: float = 30.0  # default lifetime of a lease taken without an explicit ttl
    # Re-check layer checksums on every read. The tier holds only bytes it copied itself from
    # checked or locally computed segments, so this guards against memory corruption alone,
    # and costs about half the get bandwidth (xxh3 is as slow as the copy). Readers of
    # get_layers check each layer with decode_layer either way.
    verify_gets: bool = False

    def __post_init__(self) -> None:
        self.capacity_bytes = parse_size(self.capacity_bytes)
        self.page_bytes = parse_size(self.page_bytes)
        if self.page_bytes < 4096 or self.capacity_bytes < self.page_bytes:
            raise ValueError(
                f"need page_bytes >= 4096 and capacity_bytes >= page_bytes, got "
                f"{self.page_bytes} and {self.capacity_bytes}"
            )


@dataclass(slots=True)
class CpuEntry:
    header: SegmentHeader
    pages: list[int]


class CpuTier(IndexedTier):
    """Host-memory tier. Not thread-safe: use it from one event loop. Every operation runs
    without awaiting, so a get never sees a half-written or half-evicted segment. Checksums
    are checked on get only with verify_gets (see CpuTierConfig); the gpu tier does the same."""

    name = "cpu"

    def __init__(self, config: CpuTierConfig | None = None) -> None:
        self.config = config or CpuTierConfig()
        c = self.config
        pin = torch.cuda.is_available() if c.pin_memory is None else c.pin_memory
        num_pages = c.capacity_bytes // c.page_bytes
        self._buf = torch.empty(num_pages * c.page_bytes, dtype=torch.uint8, pin_memory=pin)
        self._mv = memoryview(self._buf.numpy())
        self.pinned = pin
        self.pages = PageAllocator(num_pages)
        self.index: OrderedDict[tuple[str, bytes], CpuEntry] = (
            OrderedDict()
        )  # LRU order: oldest first
        self.counts: dict[str, int] = {}
        self.leases = Leases()
        self._stats = TierStats(
            name=self.name,
            capacity_bytes=num_pages * c.page_bytes,
            device="cpu",
            notes="pinned" if pin else "pageable",
        )
        self._get_lat, self._put_lat = Latency(), Latency()

    # -- reading ---------------------------------------------------------------------------
    async def get(self, key: bytes, ns: str = DEFAULT_NAMESPACE, out=None) -> KVSegment | None:
        check_namespace(ns)
        t0 = time.perf_counter()
        entry = self.index.get((ns, check_key(key)))
        if entry is None:
            self._stats.misses += 1
            return None
        h = entry.header
        try:
            if out is not None and h.codec == "none":
                dst = out_view(out, h.payload_raw_nbytes)
                if dst is not None:
                    for i, (off, n) in enumerate(h.layers):  # check each layer while it is in cache
                        part = dst[off - h.header_nbytes : off - h.header_nbytes + n]
                        self._gather(entry, off, off + n, part)
                        if self.config.verify_gets and checksum(part) != h.checksums[i]:
                            raise SegmentError(f"layer {i}: checksum mismatch")
                    seg = KVSegment.from_raw(h, dst, verify=False)
                else:
                    seg = copy_into(self._read(entry), h, out)
            else:
                seg = self._read(entry)
                seg = copy_into(seg, h, out) if out is not None else seg
        except SegmentError:
            self._corrupt(ns, key)
            return None
        self.index.move_to_end((ns, key))
        self._stats.hits += 1
        self._stats.bytes_out += h.nbytes
        self._get_lat.add(time.perf_counter() - t0)
        return seg

    def _read(self, entry: CpuEntry) -> KVSegment:
        """A verified copy of the whole encoded segment, owned by the caller."""
        buf = memoryview(bytearray(entry.header.nbytes))
        self._gather(entry, 0, len(buf), buf)
        return KVSegment.from_parts(entry.header, buf, verify=self.config.verify_gets)

    def _gather(self, entry: CpuEntry, start: int, stop: int, dst: memoryview) -> None:
        pb = self.config.page_bytes
        for at, logical, n in runs(entry.pages, pb, start, stop):
            dst[logical - start : logical - start + n] = self._mv[at : at + n]

    async def get_layers(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE
    ) -> AsyncIterator[LayerChunk]:
        check_namespace(ns)
        entry = self.index.get((ns, check_key(key)))
        if entry is None:
            self._stats.misses += 1
            return
        h = entry.header
        self._stats.hits += 1
        scratch = memoryview(bytearray(max(n for _, n in h.layers)))
        with self.lease(key, ns):
            for i, (off, n) in enumerate(h.layers):
                if self.index.get((ns, key)) is not entry:  # deleted while the reader was away
                    return
                data = scratch[:n]
                self._gather(entry, off, off + n, data)
                if self.config.verify_gets:
                    try:
                        decode_layer(h, i, data)
                    except SegmentError:
                        self._corrupt(ns, key)
                        return
                self._stats.bytes_out += n
                yield LayerChunk(h, i, data)

    # -- writing ---------------------------------------------------------------------------
    async def put(self, key: bytes, segment: KVSegment, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_namespace(ns)
        if segment.key != check_key(key):
            raise ValueError("segment.key does not match key")
        t0 = time.perf_counter()
        if (ns, key) in self.index:  # keys name their content: the same key is the same KV
            self.index.move_to_end((ns, key))
            return True
        try:
            h, head, blobs = segment.encode_parts()
        except SegmentError:
            self._stats.errors += 1
            return False
        pb = self.config.page_bytes
        need = -(-h.nbytes // pb)
        if need > self.pages.num_pages or not self._make_room(need):
            return False
        pages = self.pages.alloc(need)
        entry = CpuEntry(h, pages)
        self._scatter(entry, 0, head)
        for (off, _), blob in zip(h.layers, blobs):
            self._scatter(entry, off, memoryview(blob).cast("B"))
        self.index[(ns, key)] = entry
        self.counts[ns] = self.counts.get(ns, 0) + 1
        self._stats.puts += 1
        self._stats.bytes_in += h.nbytes
        self._put_lat.add(time.perf_counter() - t0)
        return True

    def _scatter(self, entry: CpuEntry, start: int, src: memoryview) -> None:
        for at, logical, n in runs(entry.pages, self.config.page_bytes, start, start + len(src)):
            self._mv[at : at + n] = src[logical - start : logical - start + n]

    def _make_room(self, need: int) -> bool:
        """Evict unleased entries, least recently used first, until `need` pages are free."""
        if self.pages.num_free >= need:
            return True
        victims, free = [], self.pages.num_free
        for ident, entry in self.index.items():
            if free >= need:
                break
            if not self.leases.held(*ident):
                victims.append(ident)
                free += len(entry.pages)
        if free < need:
            return False  # nothing is evicted unless it makes enough room
        for ns, key in victims:
            if self.on_evict is not None:
                try:
                    self.on_evict(ns, key, self._read(self.index[(ns, key)]))
                except SegmentError:
                    self._stats.errors += 1
            self._remove(ns, key)
            self._stats.evictions += 1
        return True

    async def delete(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_namespace(ns)
        return self._remove(ns, check_key(key))

    def _remove(self, ns: str, key: bytes) -> bool:
        entry = self.index.pop((ns, key), None)
        if entry is None:
            return False
        self.pages.release(entry.pages)
        self.counts[ns] -= 1
        if not self.counts[ns]:
            del self.counts[ns]
        return True

    # -- bookkeeping -----------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return (self.pages.num_pages - self.pages.num_free) * self.config.page_bytes

    def check_integrity(self) -> None:
        """Allocator and index agree: no overlap, no leak, usage within capacity."""
        self.pages.check_integrity(e.pages for e in self.index.values())
        for e in self.index.values():
            assert len(e.pages) * self.config.page_bytes >= e.header.nbytes, (
                "segment larger than its pages"
            )
        assert self.used_bytes <= self._stats.capacity_bytes, "above capacity"
        assert sum(self.counts.values()) == len(self.index), "namespace counts drifted"

    async def close(self) -> None:
        self.index.clear()
        self.counts.clear()
        self.pages = PageAllocator(self.pages.num_pages)
