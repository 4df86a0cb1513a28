"""The gpu tier: segments kept as device tensors, the hot tier beside the engine."""

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
from tierkv.storage_backends.buffers import clone_to, copy_into, with_payload
from tierkv.storage_backends.segment import KVSegment, SegmentError


@dataclass(slots=True)
class GpuTierConfig:
    capacity_bytes: int | str = "1GiB"  # payload bytes held on the device; never exceeded
    device: str | None = (
        None  # torch device; None: "cuda" when present, else "cpu" (and stats say so)
    )
    lease_ttl_s: float = 30.0  # default lifetime of a lease taken without an explicit ttl

    def __post_init__(self) -> None:
        self.capacity_bytes = parse_size(self.capacity_bytes)


class GpuTier(IndexedTier):
    """Device-memory tier. A segment returned by get (without out) shares the tier's device
    tensor: read it, never write it. Device memory is not re-checksummed on get (that would
    copy it to the host); it holds only copies made by put. Not thread-safe: one event loop."""

    name = "gpu"

    def __init__(self, config: GpuTierConfig | None = None) -> None:
        self.config = config or GpuTierConfig()
        dev = self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(dev)
        self.index: OrderedDict[tuple[str, bytes], KVSegment] = OrderedDict()  # LRU: oldest first
        self.counts: dict[str, int] = {}
        self.leases = Leases()
        self.used_bytes = 0
        notes = "" if self.device.type == "cuda" else "no CUDA: device tensors live on the CPU"
        self._stats = TierStats(
            name=self.name,
            capacity_bytes=self.config.capacity_bytes,
            device=str(self.device),
            notes=notes,
        )
        self._get_lat, self._put_lat = Latency(), Latency()

    async def get(self, key: bytes, ns: str = DEFAULT_NAMESPACE, out=None) -> KVSegment | None:
        check_namespace(ns)
        t0 = time.perf_counter()
        seg = self.index.get((ns, check_key(key)))
        if seg is None:
            self._stats.misses += 1
            return None
        self.index.move_to_end((ns, key))
        if out is not None:
            seg = copy_into(seg, seg.header(), out)
        self._stats.hits += 1
        self._stats.bytes_out += _nbytes(seg)
        self._get_lat.add(time.perf_counter() - t0)
        return seg

    async def get_layers(
        self, key: bytes, ns: str = DEFAULT_NAMESPACE
    ) -> AsyncIterator[LayerChunk]:
        check_namespace(ns)
        seg = self.index.get((ns, check_key(key)))
        if seg is None:
            self._stats.misses += 1
            return
        self._stats.hits += 1
        h = seg.header()  # codec none: a layer's encoded bytes are its raw bytes
        for i in range(seg.num_layers):
            data = memoryview(seg.payload[i].reshape(-1).view(torch.uint8).cpu().numpy())
            self._stats.bytes_out += len(data)
            yield LayerChunk(h, i, data)

    async def put(self, key: bytes, segment: KVSegment, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_namespace(ns)
        if segment.key != check_key(key):
            raise ValueError("segment.key does not match key")
        t0 = time.perf_counter()
        if (ns, key) in self.index:  # keys name their content: the same key is the same KV
            self.index.move_to_end((ns, key))
            return True
        n = _nbytes(segment)
        if n > self.config.capacity_bytes or not self._make_room(n):
            return False
        try:
            payload = clone_to(segment.payload, self.device)
        except (RuntimeError, MemoryError):  # out of device memory is a refused put, not a crash
            self._stats.errors += 1
            return False
        stored = with_payload(segment, payload)
        stored.codec = "none"  # device tensors are raw; a codec applies on the way to slower tiers
        self.index[(ns, key)] = stored
        self.counts[ns] = self.counts.get(ns, 0) + 1
        self.used_bytes += n
        self._stats.puts += 1
        self._stats.bytes_in += n
        self._put_lat.add(time.perf_counter() - t0)
        return True

    def _make_room(self, n: int) -> bool:
        free = self.config.capacity_bytes - self.used_bytes
        if free >= n:
            return True
        victims = []
        for ident, seg in self.index.items():
            if free >= n:
                break
            if not self.leases.held(*ident):
                victims.append(ident)
                free += _nbytes(seg)
        if free < n:
            return False
        for ns, key in victims:
            seg = self.index[(ns, key)]
            self._remove(ns, key)
            self._stats.evictions += 1
            if self.on_evict is not None:
                try:
                    self.on_evict(ns, key, seg)
                except SegmentError:
                    self._stats.errors += 1
        return True

    async def delete(self, key: bytes, ns: str = DEFAULT_NAMESPACE) -> bool:
        check_namespace(ns)
        return self._remove(ns, check_key(key))

    def _remove(self, ns: str, key: bytes) -> bool:
        seg = self.index.pop((ns, key), None)
        if seg is None:
            return False
        self.used_bytes -= _nbytes(seg)
        self.counts[ns] -= 1
        if not self.counts[ns]:
            del self.counts[ns]
        return True

    def check_integrity(self) -> None:
        assert self.used_bytes == sum(_nbytes(s) for s in self.index.values()), "used bytes drifted"
        assert self.used_bytes <= self.config.capacity_bytes, "above capacity"
        assert sum(self.counts.values()) == len(self.index), "namespace counts drifted"

    async def close(self) -> None:
        self.index.clear()
        self.counts.clear()
        self.used_bytes = 0


def _nbytes(seg: KVSegment) -> int:
    return seg.payload.numel() * seg.payload.element_size()
