"""The cpu tier's streams: layer-major, each layer gathered from the tier's pages straight into
the reader's buffer, the keys leased for the stream's length."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tierkv.storage_backends.names import check_key, check_namespace
from tierkv.storage_backends.segment import SegmentError, checksum, decode_layer_bytes
from tierkv.storage_backends.stream import LayerSink, open_all, reader_checks

if TYPE_CHECKING:
    from tierkv.storage_backends.cpu_tier import CpuEntry, CpuTier


async def stream_pages(tier: CpuTier, keys: Sequence[bytes], ns: str, sink: LayerSink) -> None:
    """Layer-major, each layer gathered from the pages straight into the sink's buffer and
    checked there, unless the reader checks it next (`reader_checks`) and verify_gets is
    off."""
    check_namespace(ns)
    entries = [tier.index.get((ns, check_key(k))) for k in keys]
    tier._stats.misses += entries.count(None)
    live = open_all(sink, ["miss" if e is None else e.header for e in entries])
    holds = [tier.lease(keys[i], ns) for i in live]
    try:
        layer = 0
        while live:
            placed = [i for i in live if _place(tier, ns, keys[i], i, entries[i], layer, sink)]
            if placed:
                await sink.ready(layer)
            live = [i for i in placed if layer + 1 < _layers(entries[i])]
            layer += 1
    finally:
        for h in holds:
            h.release()


def _layers(e: CpuEntry | None) -> int:
    return 0 if e is None else e.header.num_layers


def _place(
    tier: CpuTier, ns: str, key: bytes, i: int, e: CpuEntry | None, layer: int, sink: LayerSink
) -> bool:
    """Layer of key i (entry e) into the sink; False when it was dropped instead."""
    assert e is not None
    if tier.index.get((ns, key)) is not e:  # deleted while the stream was away
        sink.drop(i, "miss: deleted midway")
        return False
    h = e.header
    off, n = h.layers[layer]
    dst = sink.into(i, layer)
    try:
        if h.codec == "none":
            tier._gather(e, off, off + n, dst)
            check = tier.config.verify_gets or not reader_checks(sink)
            if check and checksum(dst) != h.checksums[layer]:
                raise SegmentError(f"layer {layer}: checksum mismatch")
        else:
            scratch = memoryview(bytearray(n))
            tier._gather(e, off, off + n, scratch)
            dst[:] = decode_layer_bytes(h, layer, scratch)
    except SegmentError as err:
        tier._corrupt(ns, key)
        sink.drop(i, f"miss: corrupt: {err}")
        return False
    tier._stats.bytes_out += n
    if layer + 1 == h.num_layers:
        tier._touch(ns, key)
        tier._stats.hits += 1
    return True
