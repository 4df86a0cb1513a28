"""The cpu tier: encoded segments laid over fixed pages of one preallocated host buffer."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.storage_backends.buffers import out_view
from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.eviction import make_policy
from tierkv.storage_backends.indexed_tier import IndexedTier
from tierkv.storage_backends.invariants import InvariantError, invariant
from tierkv.storage_backends.names import check_key, check_namespace
from tierkv.storage_backends.page_landing import Landing, land
from tierkv.storage_backends.page_views import PageViews, open_views
from tierkv.storage_backends.pages import PageAllocator, runs
from tierkv.storage_backends.segment import (
    KVSegment,
    SegmentError,
    SegmentHeader,
    checksum,
    decode_layer,
    decode_layer_bytes,
)
from tierkv.storage_backends.sizes import parse_size
from tierkv.storage_backends.stream import LayerSink, open_all, reader_checks
from tierkv.storage_backends.tier import SegmentLayer


@dataclass(slots=True)
class CpuTierConfig:
    capacity_bytes: int | str = "1GiB"  # the whole buffer, allocated once at start; never exceeded
    page_bytes: int | str = "256KiB"  # allocation unit; a segment wastes < 1 page
    pin_memory: bool | None = None  # page-lock the buffer for fast H2D copies; None: with CUDA
    lease_ttl_s: float = 30.0  # default lifetime of a lease taken without an explicit ttl
    # Re-check layer checksums on every read. The tier holds only bytes it copied itself from
    # checked or locally computed segments, so this guards against memory corruption alone,
    # and costs about half the get bandwidth (xxh3 is as slow as the copy). Readers of
    # get_layers check each layer with decode_layer either way.
    verify_gets: bool = False
    # eviction order when room is needed (storage_backends.eviction): "lru" (oldest first) or
    # "hinted" (farthest next use by workflow hints first; unhinted entries by LRU)
    eviction: str = "lru"
    # namespace -> its byte share of this tier ("256MiB", 4096, or "25%"; "*": each namespace
    # not named; unnamed without "*": 0): namespaces over their share are evicted first
    quotas: dict[str, int | str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.capacity_bytes = parse_size(self.capacity_bytes)
        self.page_bytes = parse_size(self.page_bytes)
        if self.page_bytes < 4096 or self.capacity_bytes < self.page_bytes:
            raise ValueError(
                f"need page_bytes >= 4096 and capacity_bytes >= page_bytes, got "
                f"{self.page_bytes} and {self.capacity_bytes}"
            )


@dataclass(slots=True, eq=False)
class CpuEntry:
    header: SegmentHeader
    pages: list[int]
    readers: int = 0  # zero-copy readers of its pages (payload_views) not yet released
    gone: bool = False  # out of the index, its pages kept until the last reader ends


class CpuTier(IndexedTier[CpuEntry]):
    """Host-memory tier. Not thread-safe: use it from one event loop. Every operation runs
    without awaiting, so a get never sees a half-written or half-evicted segment. Checksums
    are checked on get only with verify_gets (see CpuTierConfig); the gpu tier does the same."""

    name = "cpu"

    def __init__(self, config: CpuTierConfig | None = None) -> None:
        self.config = config or CpuTierConfig()
        c = self.config
        self.page_bytes = pb = parse_size(c.page_bytes)
        pin = torch.cuda.is_available() if c.pin_memory is None else c.pin_memory
        num_pages = parse_size(c.capacity_bytes) // pb
        self._buf = torch.empty(num_pages * pb, dtype=torch.uint8, pin_memory=pin)
        self._mv = self._buf.numpy().data
        self.pinned = pin
        self.pages = PageAllocator(num_pages)
        self.kept: list[CpuEntry] = []  # deleted while read: freed when their readers end
        self.landing: list[CpuEntry] = []  # being received into (page_landing), not indexed
        self._start_index(
            num_pages * pb,
            c.lease_ttl_s,
            make_policy(c.eviction, c.quotas, num_pages * pb),
            device="cpu",
            notes="pinned" if pin else "pageable",
        )

    # -- reading ---------------------------------------------------------------------------
    async def _read(self, ns: str, key: bytes, out: Any) -> tuple[KVSegment, int] | None:
        entry = self.index.get((ns, key))
        if entry is None:
            return None
        h = entry.header
        try:
            raw = out is not None and h.codec == "none"
            dst = out_view(out, h.payload_raw_nbytes) if raw else None
            if dst is None:
                return self._copy(entry), h.nbytes
            for i, (off, n) in enumerate(h.layers):  # check each layer while it is in cache
                part = dst[off - h.header_nbytes : off - h.header_nbytes + n]
                self._gather(entry, off, off + n, part)
                if self.config.verify_gets and checksum(part) != h.checksums[i]:
                    raise SegmentError(f"layer {i}: checksum mismatch")
            return KVSegment.from_raw(h, dst, verify=False), h.nbytes
        except SegmentError:
            self._corrupt(ns, key)
            return None

    def payload_views(self, key: bytes, ns: str) -> PageViews | None:
        """key's payload as views of the tier's pages, no copy, held until released
        (storage_backends.page_views); None on a miss or for a compressed segment."""
        return open_views(self, check_namespace(ns), check_key(key))

    def land(self, key: bytes, ns: str, header: SegmentHeader) -> Landing | None:
        """Where header's encoded segment is received into the tier's pages, taken as it arrives,
        then committed or aborted (storage_backends.page_landing); None when it cannot land."""
        return land(self, check_namespace(ns), check_key(key), header, CpuEntry)

    def _copy(self, entry: CpuEntry) -> KVSegment:
        """A verified copy of the whole encoded segment, owned by the caller."""
        buf = torch.empty(entry.header.nbytes, dtype=torch.uint8).numpy().data  # not zeroed
        self._gather(entry, 0, len(buf), buf)
        return KVSegment.from_parts(entry.header, buf, verify=self.config.verify_gets)

    def _gather(self, entry: CpuEntry, start: int, stop: int, dst: memoryview) -> None:
        copied("cpu.get", stop - start)
        for at, logical, n in runs(entry.pages, self.page_bytes, start, stop):
            dst[logical - start : logical - start + n] = self._mv[at : at + n]

    async def stream(self, keys: Sequence[bytes], ns: str, sink: LayerSink) -> None:
        """Layer-major, each layer gathered from the pages straight into the sink's buffer and
        checked there, unless the reader checks it next (`reader_checks`) and verify_gets is
        off."""
        check_namespace(ns)
        entries = [self.index.get((ns, check_key(k))) for k in keys]
        self._stats.misses += entries.count(None)
        live = open_all(sink, ["miss" if e is None else e.header for e in entries])
        holds = [self.lease(keys[i], ns) for i in live]
        try:
            layer = 0
            while live:
                placed = [i for i in live if self._place(ns, keys[i], i, entries[i], layer, sink)]
                if placed:
                    await sink.ready(layer)
                live = [i for i in placed if layer + 1 < self._layers(entries[i])]
                layer += 1
        finally:
            for h in holds:
                h.release()

    @staticmethod
    def _layers(e: CpuEntry | None) -> int:
        return 0 if e is None else e.header.num_layers

    def _place(
        self, ns: str, key: bytes, i: int, e: CpuEntry | None, layer: int, sink: LayerSink
    ) -> bool:
        """Layer of key i (entry e) into the sink; False when it was dropped instead."""
        assert e is not None
        if self.index.get((ns, key)) is not e:  # deleted while the stream was away
            sink.drop(i, "miss: deleted midway")
            return False
        h = e.header
        off, n = h.layers[layer]
        dst = sink.into(i, layer)
        try:
            if h.codec == "none":
                self._gather(e, off, off + n, dst)
                check = self.config.verify_gets or not reader_checks(sink)
                if check and checksum(dst) != h.checksums[layer]:
                    raise SegmentError(f"layer {layer}: checksum mismatch")
            else:
                scratch = memoryview(bytearray(n))
                self._gather(e, off, off + n, scratch)
                dst[:] = decode_layer_bytes(h, layer, scratch)
        except SegmentError as err:
            self._corrupt(ns, key)
            sink.drop(i, f"miss: corrupt: {err}")
            return False
        self._stats.bytes_out += n
        if layer + 1 == h.num_layers:
            self._touch(ns, key)
            self._stats.hits += 1
        return True

    async def _read_layers(self, ns: str, key: bytes) -> AsyncGenerator[SegmentLayer, None]:
        entry = self.index.get((ns, key))
        if entry is None:
            return
        h = entry.header
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
                yield SegmentLayer(h, i, data)

    # -- writing ---------------------------------------------------------------------------
    async def _write(self, ns: str, key: bytes, segment: KVSegment) -> int | None:
        try:
            h, head, blobs = segment.encode_parts()
        except SegmentError:
            self._stats.errors += 1
            return None
        need = -(-h.nbytes // self.page_bytes)
        if not self._make_room(need * self.page_bytes, ns):
            return None
        pages = self.pages.alloc(need)
        if pages is None:  # _make_room made the room: the allocator disagrees with the index
            raise InvariantError(f"{need} pages fit by the index, not by the allocator")
        entry = CpuEntry(h, pages)
        self._scatter(entry, 0, memoryview(head))
        for (off, _), blob in zip(h.layers, blobs):
            self._scatter(entry, off, memoryview(blob).cast("B"))
        self._add(ns, key, entry)
        return h.nbytes

    def _scatter(self, entry: CpuEntry, start: int, src: memoryview) -> None:
        copied("cpu.put", len(src))
        for at, logical, n in runs(entry.pages, self.page_bytes, start, start + len(src)):
            self._mv[at : at + n] = src[logical - start : logical - start + n]

    # -- the index's hooks -----------------------------------------------------------------
    def _entry_bytes(self, entry: CpuEntry) -> int:
        return len(entry.pages) * self.page_bytes

    def _release(self, entry: CpuEntry) -> None:
        if entry.readers:  # a zero-copy reader still sends from these pages
            entry.gone = True
            self.kept.append(entry)
            self.reserved_bytes += self._entry_bytes(entry)
        else:
            self.pages.release(entry.pages)

    def _in_use(self, entry: CpuEntry) -> bool:
        return entry.readers > 0

    def _evicted(self, entry: CpuEntry) -> KVSegment:
        return self._copy(entry)

    def _check_entries(self) -> None:
        """The allocator agrees with the index: no overlap, no leak; each segment fits its pages."""
        held = [*self.index.values(), *self.kept, *self.landing]
        self.pages.check_integrity(e.pages for e in held)
        kept = sum(self._entry_bytes(e) for e in [*self.kept, *self.landing])
        invariant(kept == self.reserved_bytes, "pages kept or landing but not reserved")
        for e in self.index.values():
            invariant(
                len(e.pages) * self.page_bytes >= e.header.nbytes, "segment larger than its pages"
            )

    async def close(self) -> None:
        self.index.clear()
        self.counts.clear()
        self.reserved_bytes -= sum(self._entry_bytes(e) for e in self.landing)
        self.landing.clear()  # their Landings end as no-ops
        self.used_bytes = 0
        self.pages = PageAllocator(self.pages.num_pages)
