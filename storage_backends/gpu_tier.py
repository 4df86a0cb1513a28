"""The gpu tier: segments kept as device tensors, the hot tier beside the engine."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.storage_backends.buffers import clone_to
from tierkv.storage_backends.eviction import make_policy
from tierkv.storage_backends.indexed_tier import IndexedTier
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.sizes import parse_size
from tierkv.storage_backends.tier import SegmentLayer


@dataclass(slots=True)
class GpuTierConfig:
    capacity_bytes: int | str = "1GiB"  # payload bytes held on the device; never exceeded
    device: str | None = None  # torch device; None: "cuda" when present, else "cpu" (stats say so)
    lease_ttl_s: float = 30.0  # default lifetime of a lease taken without an explicit ttl
    # eviction order when room is needed (storage_backends.eviction): "lru" (oldest first) or
    # "hinted" (farthest next use by workflow hints first; unhinted entries by LRU)
    eviction: str = "lru"
    # namespace -> its byte share of this tier ("256MiB", 4096, or "25%"; "*": each namespace
    # not named; unnamed without "*": 0): namespaces over their share are evicted first
    quotas: dict[str, int | str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.capacity_bytes = parse_size(self.capacity_bytes)


class GpuTier(IndexedTier[KVSegment]):
    """Device-memory tier. A segment returned by get (without out) shares the tier's device
    tensor: read it, never write it. Device memory is not re-checksummed on get (that would
    copy it to the host); it holds only copies made by put. Not thread-safe: one event loop."""

    name = "gpu"

    def __init__(self, config: GpuTierConfig | None = None) -> None:
        self.config = config or GpuTierConfig()
        dev = self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(dev)
        notes = "" if self.device.type == "cuda" else "no CUDA: device tensors live on the CPU"
        c, cap = self.config, parse_size(self.config.capacity_bytes)
        self._start_index(
            cap,
            c.lease_ttl_s,
            make_policy(c.eviction, c.quotas, cap),
            device=str(self.device),
            notes=notes,
        )

    async def _read(self, ns: str, key: bytes, out: Any) -> tuple[KVSegment, int] | None:
        seg = self.index.get((ns, key))
        return None if seg is None else (seg, _nbytes(seg))

    async def _read_layers(self, ns: str, key: bytes) -> AsyncGenerator[SegmentLayer, None]:
        seg = self.index.get((ns, key))
        if seg is None:
            return
        h = seg.full_header()  # codec none: a layer's encoded bytes are its raw bytes
        for i in range(seg.num_layers):
            data = seg.payload[i].reshape(-1).view(torch.uint8).cpu().numpy().data
            yield SegmentLayer(h, i, data)

    async def _write(self, ns: str, key: bytes, segment: KVSegment) -> int | None:
        n = _nbytes(segment)
        if not self._make_room(n, ns):
            return None
        try:
            payload = clone_to(segment.payload, self.device)
        except (RuntimeError, MemoryError):  # out of device memory is a refused put, not a crash
            self._stats.errors += 1
            return None
        # device tensors are raw; a codec applies on the way to slower tiers
        stored = KVSegment(dataclasses.replace(segment.header, codec="none"), payload)
        self._add(ns, key, stored)
        return n

    def _entry_bytes(self, entry: KVSegment) -> int:
        return _nbytes(entry)

    def _release(self, entry: KVSegment) -> None:
        pass  # the tensor goes with the last reference to it

    def _evicted(self, entry: KVSegment) -> KVSegment:
        return entry

    async def close(self) -> None:
        self.index.clear()
        self.counts.clear()
        self.used_bytes = 0


def _nbytes(seg: KVSegment) -> int:
    return seg.payload.numel() * seg.payload.element_size()
