"""The disk tier's streams: files opened once, each layer read at its offset (preadv) straight
into the reader's buffer on a worker thread, and checked there."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tierkv.storage_backends.names import check_key, check_namespace
from tierkv.storage_backends.segment import (
    SegmentError,
    SegmentHeader,
    checksum,
    decode_layer_bytes,
)
from tierkv.storage_backends.segment_files import check_same_header
from tierkv.storage_backends.stream import LayerSink, open_all

if TYPE_CHECKING:
    from tierkv.storage_backends.disk_tier import DiskEntry, DiskTier


async def stream_files(tier: DiskTier, keys: Sequence[bytes], ns: str, sink: LayerSink) -> None:
    """Layer-major by positioned reads (preadv) on files opened once, each layer read
    straight into the sink's buffer (codec none) on a worker thread and checked there."""
    check_namespace(ns)
    entries = [tier.index.get((ns, check_key(k))) for k in keys]
    loop = asyncio.get_running_loop()
    fds = await loop.run_in_executor(None, _open_all, entries)
    found: list[SegmentHeader | str] = []
    for i, (e, fd) in enumerate(zip(entries, fds)):
        if e is not None and fd >= 0:
            found.append(e.header)
            continue
        tier._stats.misses += 1
        if e is not None:
            tier._corrupt(ns, keys[i])
        found.append("miss" if e is None else "miss: file gone or changed")
    live = open_all(sink, found)
    holds = [tier.lease(keys[i], ns) for i in live]
    try:
        layer = 0
        while live:
            dsts = [sink.into(i, layer) for i in live]
            jobs = [(fds[i], entries[i].header, dst) for i, dst in zip(live, dsts)]  # type: ignore[union-attr]
            errs = await loop.run_in_executor(None, _read_layer, jobs, layer)
            placed = []
            for i, err in zip(live, errs):
                if err is None:
                    placed.append(i)
                    tier._stats.bytes_out += dsts[0].nbytes
                else:
                    tier._corrupt(ns, keys[i])
                    sink.drop(i, f"miss: corrupt: {err}")
            if placed:
                await sink.ready(layer)
            layer += 1
            live = [i for i in placed if layer < entries[i].header.num_layers]  # type: ignore[union-attr]
            tier._stats.hits += len(placed) - len(live)
    finally:
        for h in holds:
            h.release()
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def _open_all(entries: list[DiskEntry | None]) -> list[int]:
    """An fd per entry whose file still holds the indexed header (-1 where none or not)."""
    fds = []
    for e in entries:
        fd = -1
        if e is not None:
            try:
                fd = os.open(e.path, os.O_RDONLY | os.O_CLOEXEC)
                head = os.pread(fd, e.header.header_nbytes, 0)
                check_same_header(e.prefix, head)
                if os.fstat(fd).st_size != e.header.nbytes:
                    raise SegmentError("file length does not match its header")
            except (OSError, SegmentError):
                if fd >= 0:
                    os.close(fd)
                fd = -1
        fds.append(fd)
    return fds


def _read_layer(jobs: list[tuple[int, SegmentHeader, memoryview]], layer: int) -> list[str | None]:
    """One layer of each (fd, header, destination): read at its offset, decoded, checked."""
    out: list[str | None] = []
    for fd, h, dst in jobs:
        off, n = h.layers[layer]
        try:
            if h.codec == "none":
                if os.preadv(fd, [dst], off) != n:
                    raise SegmentError(f"layer {layer}: file shorter than its header says")
                if checksum(dst) != h.checksums[layer]:
                    raise SegmentError(f"layer {layer}: checksum mismatch")
            else:
                dst[:] = decode_layer_bytes(h, layer, os.pread(fd, n, off))
            out.append(None)
        except (OSError, SegmentError) as e:
            out.append(str(e))
    return out
