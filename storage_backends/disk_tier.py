"""The disk tier: one self-describing segment file per entry, root/<namespace>/<keyhex>.tkv."""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiofiles

from tierkv.storage_backends.buffers import out_view
from tierkv.storage_backends.disk_stream import stream_files
from tierkv.storage_backends.eviction import make_policy
from tierkv.storage_backends.indexed_tier import IndexedTier
from tierkv.storage_backends.names import check_namespace
from tierkv.storage_backends.segment import (
    PREFIX_NBYTES,
    KVSegment,
    SegmentError,
    SegmentHeader,
    checksum,
    decode_layer,
)
from tierkv.storage_backends.segment_files import (
    check_same_header,
    load,
    read_aio,
    read_cached,
    read_header,
)
from tierkv.storage_backends.sizes import parse_size
from tierkv.storage_backends.stream import LayerSink
from tierkv.storage_backends.tier import SegmentLayer

_NAME = re.compile(r"[0-9a-f]{32}\.tkv")


@dataclass(slots=True)
class DiskTierConfig:
    root: str | Path = (
        "tierkv-cache"  # directory of the cache; created if missing; kept across restarts
    )
    capacity_bytes: int | str = "16GiB"  # total bytes of segment files; never exceeded
    fsync: bool = True  # fsync each file before its rename, so a crash leaves whole files or none
    lease_ttl_s: float = 30.0  # default lifetime of a lease taken without an explicit ttl
    # eviction order when room is needed (storage_backends.eviction): "lru" (oldest first) or
    # "hinted" (farthest next use by workflow hints first; unhinted entries by LRU)
    eviction: str = "lru"
    # namespace -> its byte share of this tier ("256MiB", 4096, or "25%"; "*": each namespace
    # not named; unnamed without "*": 0): namespaces over their share are evicted first
    quotas: dict[str, int | str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.capacity_bytes = parse_size(self.capacity_bytes)


@dataclass(slots=True)
class DiskEntry:
    path: Path
    header: SegmentHeader
    prefix: bytes  # the file's first PREFIX_NBYTES, which hold the header's checksum


class DiskTier(IndexedTier[DiskEntry]):
    """File tier. Writes go to a temp name, are fsynced, then renamed: a reader sees a whole file
    or none. At start the index is rebuilt from the file headers (LRU order by mtime); temp,
    partial and corrupt files are removed. A read or write fault is a miss or False, counted."""

    name = "disk"

    def __init__(self, config: DiskTierConfig | None = None) -> None:
        self.config = config or DiskTierConfig()
        self.root = Path(self.config.root)
        self._pending: dict[tuple[str, bytes], asyncio.Future[bool]] = {}
        c, cap = self.config, parse_size(self.config.capacity_bytes)
        policy = make_policy(c.eviction, c.quotas, cap)
        self._start_index(cap, c.lease_ttl_s, policy, device=str(self.root))
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        found = []
        for d in sorted(p for p in self.root.iterdir() if p.is_dir()):
            try:
                ns = check_namespace(d.name)
            except ValueError:
                continue  # not ours
            for f in d.iterdir():
                if f.name.endswith(".tmp"):
                    f.unlink(missing_ok=True)  # an interrupted write
                elif _NAME.fullmatch(f.name):
                    got = read_header(f)
                    if got is None or got[0].key.hex() != f.name[:32]:
                        self._stats.errors += 1
                        f.unlink(missing_ok=True)
                    else:
                        found.append((f.stat().st_mtime_ns, ns, got, f))
        for _, ns, (header, prefix), f in sorted(found, key=lambda x: x[0]):
            self._add(ns, header.key, DiskEntry(f, header, prefix))
        while self.used_bytes > self.capacity_bytes:  # the capacity was lowered
            ns, key = next(iter(self.index))
            self._remove(ns, key)
            self._stats.evictions += 1

    def _path(self, ns: str, key: bytes) -> Path:
        return self.root / ns / f"{key.hex()}.tkv"

    # -- reading ---------------------------------------------------------------------------
    async def _read(self, ns: str, key: bytes, out: Any) -> tuple[KVSegment, int] | None:
        entry = self.index.get((ns, key))
        if entry is None:
            return None
        h = entry.header
        dst = out_view(out, h.payload_raw_nbytes) if out is not None and h.codec == "none" else None
        head = memoryview(bytearray(h.header_nbytes if dst is not None else h.nbytes))
        spans = [(0, head)]
        if dst is not None:  # the payload straight into the caller's buffer, layer by layer
            spans += [
                (off, dst[off - h.header_nbytes : off - h.header_nbytes + n]) for off, n in h.layers
            ]

        def check(j: int) -> None:  # each layer while it is still in cache
            if j and checksum(spans[j][1]) != h.checksums[j - 1]:
                raise SegmentError(f"layer {j - 1}: checksum mismatch")

        try:
            with self.lease(key, ns):
                cached = read_cached(
                    entry.path, spans, h.nbytes, check if dst is not None else None
                )
                if (
                    not cached
                ):  # a cold read: few large reads, as each aiofiles call is a thread hop
                    await read_aio(entry.path, [head] if dst is None else [head, dst], h.nbytes)
            check_same_header(entry.prefix, head[: h.header_nbytes])
            if dst is not None:  # cached reads were checked per layer
                return KVSegment.from_raw(h, dst, verify=not cached), h.nbytes
            return KVSegment.from_parts(h, head), h.nbytes
        except (OSError, SegmentError):
            self._corrupt(ns, key)
            return None

    async def stream(self, keys: Sequence[bytes], ns: str, sink: LayerSink) -> None:
        """Layer-major by positioned reads on files opened once (storage_backends.disk_stream)."""
        await stream_files(self, keys, ns, sink)

    async def _read_layers(self, ns: str, key: bytes) -> AsyncGenerator[SegmentLayer, None]:
        entry = self.index.get((ns, key))
        if entry is None:
            return
        h = entry.header
        scratch = memoryview(bytearray(max(n for _, n in h.layers)))
        with self.lease(key, ns):
            try:
                async with aiofiles.open(entry.path, "rb") as f:
                    head = bytearray(h.header_nbytes)
                    if await f.readinto(head) != len(head):
                        raise SegmentError("truncated header")
                    check_same_header(entry.prefix, head)
                    for i, (_, n) in enumerate(h.layers):
                        data = scratch[:n]
                        if await f.readinto(data) != n:
                            raise SegmentError(f"truncated layer {i}")
                        decode_layer(h, i, data)
                        yield SegmentLayer(h, i, data)
            except (OSError, SegmentError):
                self._corrupt(ns, key)

    # -- writing ---------------------------------------------------------------------------
    async def _write(self, ns: str, key: bytes, segment: KVSegment) -> int | None:
        ident = (ns, key)
        if ident in self._pending:  # the same key being written: share that write's result
            return 0 if await asyncio.shield(self._pending[ident]) else None
        fut = asyncio.get_running_loop().create_future()
        self._pending[ident] = fut
        n = None
        try:
            n = await self._write_file(ns, key, segment)
        finally:
            del self._pending[ident]
            fut.set_result(n is not None)
        return n

    async def _write_file(self, ns: str, key: bytes, segment: KVSegment) -> int | None:
        try:
            h, head, blobs = segment.encode_parts()
        except SegmentError:
            self._stats.errors += 1
            return None
        if not self._make_room(h.nbytes, ns):
            return None
        self.reserved_bytes += h.nbytes  # reserved now, so concurrent writes cannot overshoot
        path = self._path(ns, key)
        tmp = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            async with aiofiles.open(tmp, "wb") as f:
                await f.write(head)
                for blob in blobs:
                    await f.write(blob)
                await f.flush()
                if self.config.fsync:
                    await asyncio.to_thread(os.fsync, f.fileno())
            os.replace(tmp, path)
        except OSError:  # read-only directory, disk full, permissions
            self._stats.errors += 1
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return None
        finally:
            self.reserved_bytes -= h.nbytes
        self._add(ns, key, DiskEntry(path, h, bytes(head[:PREFIX_NBYTES])))
        return h.nbytes

    # -- the index's hooks -----------------------------------------------------------------
    def _entry_bytes(self, entry: DiskEntry) -> int:
        return entry.header.nbytes

    def _release(self, entry: DiskEntry) -> None:
        try:
            entry.path.unlink(missing_ok=True)
        except OSError:
            self._stats.errors += 1

    def _evicted(self, entry: DiskEntry) -> KVSegment | None:
        return load(entry.path)

    async def close(self) -> None:
        for fut in list(self._pending.values()):
            await asyncio.shield(fut)
