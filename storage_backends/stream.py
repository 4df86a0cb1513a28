"""Layer-major loads of several keys at once: layer 0 of every key, then layer 1, and so on,
each layer written into the reader's buffers as it arrives.

A reader that injects KV layer by layer (the connector) uses layer l as soon as every key has
delivered it, while layers l+1.. are still on their way: the forward of layer l overlaps the
transfer of the layers after it.

Safety contract of every `Tier.stream(keys, ns, sink)`:
- `sink.open(i, h)` is called at most once per key, with a checked header whose key is
  keys[i], before any byte of that key is written;
- a layer's bytes are written only into `sink.into(i, layer)`, decoded, and are checked against
  the header's layer checksum before `sink.ready(layer)` is awaited;
- `ready(layer)` is awaited once per layer, in order, after that layer of every key still
  live is in place; the stream writes nothing of the next layer before it returns;
- a key missing, refused by `open` or failing midway gets `drop(i, why)` once, and nothing of
  it is written or made ready afterwards;
- a tier fault never raises: it drops the keys it touched. Reasons: "miss", or "miss: ..."
  for an entry absent, gone midway or found corrupt (the tier's miss, as a get's), "refused"
  (by `open`), "tier error: ..." (the tier unreachable or failing), anything else for a
  reply that does not fit what was asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

import torch

from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.segment import KVSegment, SegmentError, decode_layer_bytes


class LayerSink(Protocol):
    # Optional attribute `checks = True`: whoever reads the layers next checks each checksum
    # itself (a server sending to its client), so a memory tier may skip its own check of
    # bytes it holds (disk and Redis bytes are checked always). See `reader_checks`.
    # Optional method `place(i, layer, data)`: the sink reads a layer where it already lies,
    # checked (read-only `data`, valid until the stream returns), instead of having it copied
    # into `into(i, layer)`; a data plane session over shared memory hands its region's ranges
    # this way (cacheserver.dataplane.stream_client). Other tiers ignore it.

    def open(self, i: int, header: SegmentHeader) -> bool:
        """Whether key i's segment is wanted (False drops it)."""

    def into(self, i: int, layer: int) -> memoryview:
        """Where key i's layer goes, decoded: header.layer_raw_nbytes writable bytes."""

    def drop(self, i: int, why: str) -> None:
        """Key i is missing or failed; nothing more of it comes."""

    async def ready(self, layer: int) -> None:
        """Layer `layer` of every key not dropped is in place and checked."""


def reader_checks(sink: LayerSink) -> bool:
    return bool(getattr(sink, "checks", False))


class Layered(Protocol):  # what stream_layers reads: a tier's get_layers
    header: SegmentHeader
    layer: int
    data: memoryview


async def stream_layers(
    get_layers: Callable[[bytes], AsyncIterator[Layered]],
    keys: Sequence[bytes],
    sink: LayerSink,
) -> None:
    """Any tier's stream, from its per-key `get_layers`: each round advances every live key's
    reader by one layer, concurrently (Redis GETRANGEs and file reads overlap)."""
    readers = [get_layers(k) for k in keys]
    heads: list[SegmentHeader | None] = [None] * len(keys)
    live, layer = list(range(len(keys))), 0
    try:
        while live:
            got = await asyncio.gather(
                *(anext(readers[i], None) for i in live), return_exceptions=True
            )
            placed = []
            for i, part in zip(live, got):
                why = _place(sink, i, keys[i], layer, part, heads)
                if why is None:
                    placed.append(i)
                else:
                    sink.drop(i, why)
            if placed:
                await sink.ready(layer)
            live = [i for i in placed if layer + 1 < _layers(heads[i])]
            # Run each finished reader to its end: it books the hit there.
            await asyncio.gather(
                *(anext(readers[i], None) for i in placed if i not in live),
                return_exceptions=True,
            )
            layer += 1
    finally:
        for r in readers:
            close = getattr(r, "aclose", None)
            if close is not None:
                await close()


async def stream_whole(
    get: Callable[[bytes], Awaitable[KVSegment | None]], keys: Sequence[bytes], sink: LayerSink
) -> None:
    """A stream from whole-segment gets, all at once (a tier whose reads batch, like gRPC's
    GetMany): no layer is ready before every key has arrived, but nothing is asked twice.
    `get` returns checked segments."""
    got = await asyncio.gather(*(get(k) for k in keys), return_exceptions=True)
    live = open_all(sink, [_found(seg, k) for seg, k in zip(got, keys)])
    for layer in range(max((got[i].num_layers for i in live), default=0)):  # type: ignore[union-attr]
        placed = [i for i in live if layer < got[i].num_layers]  # type: ignore[union-attr]
        for i in placed:
            part = got[i].layer(layer)  # type: ignore[union-attr]
            sink.into(i, layer)[:] = part.contiguous().reshape(-1).view(torch.uint8).numpy().data
            copied("stream.whole", part.numel() * part.element_size())
        await sink.ready(layer)


def _found(seg: KVSegment | None | BaseException, key: bytes) -> SegmentHeader | str:
    """A whole-segment get's header, or why there is none."""
    if isinstance(seg, BaseException):
        return f"tier error: {seg!r}"
    if seg is None:
        return "miss"
    return seg.full_header() if seg.key == key else "the tier answered another key"


def open_all(sink: LayerSink, found: Sequence[SegmentHeader | str | None]) -> list[int]:
    """Open each key whose header a tier found (a refusal drops it) and drop the others with
    the reason in their place (None: dropped already); the keys left to stream."""
    live = []
    for i, h in enumerate(found):
        if h is None:
            continue
        if isinstance(h, str):
            sink.drop(i, h)
        elif sink.open(i, h):
            live.append(i)
        else:
            sink.drop(i, "refused")
    return live


def _layers(head: SegmentHeader | None) -> int:
    return 0 if head is None else head.num_layers


def _place(
    sink: LayerSink,
    i: int,
    key: bytes,
    layer: int,
    part: Layered | BaseException | None,
    heads: list[SegmentHeader | None],
) -> str | None:
    """Write one key's layer where the sink wants it; why not, when it cannot."""
    if isinstance(part, BaseException):
        return f"tier error: {part!r}"
    if part is None:
        return "miss" if layer == 0 else f"miss: stream ended at layer {layer}"
    if part.layer != layer:
        return f"layer {part.layer} came where {layer} was due"
    if layer == 0:
        if part.header.key != key:
            return "the tier answered another key"
        if not sink.open(i, part.header):
            heads[i] = None
            return "refused"
        heads[i] = part.header
    head = heads[i]
    if head is None or part.header is not head and part.header != head:
        return "the header changed midway"
    try:
        sink.into(i, layer)[:] = decode_layer_bytes(head, layer, part.data)
    except SegmentError as e:
        return f"miss: corrupt: {e}"
    return None
