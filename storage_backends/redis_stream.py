"""The Redis tier's streams: one pipeline of GETRANGEs per round for all keys, a round for the
headers and one per layer, each layer decoded straight into the reader's buffer and checked.
A stream of n keys and L layers costs L + 1 round trips (L + 2 when a header is long)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tierkv.storage_backends.names import check_key, check_namespace
from tierkv.storage_backends.segment import SegmentError, SegmentHeader, decode_layer_bytes
from tierkv.storage_backends.stream import LayerSink, open_all

if TYPE_CHECKING:
    from tierkv.storage_backends.redis_tier import RedisTier

HEAD_GUESS = 4096  # bytes read first: the prefix and, for chunks up to ~900 tokens, the header


async def stream_values(tier: RedisTier, keys: Sequence[bytes], ns: str, sink: LayerSink) -> None:
    check_namespace(ns)
    names = [tier._name(ns, check_key(k)) for k in keys]

    async def ranges(spans: list[tuple[int, int, int]]) -> list[bytes] | None:
        """GETRANGE name[i] start..end for each (i, start, end), pipelined; None if Redis
        failed (counted and backed off by the tier)."""

        async def run() -> list[bytes]:
            async with tier.client.pipeline(transaction=False) as pipe:
                for i, a, b in spans:
                    pipe.getrange(names[i], a, b)
                return await pipe.execute()

        return await tier._call("getrange", run()) if spans and tier._up() else None

    heads: list[SegmentHeader | None] = [None] * len(keys)
    first = await ranges([(i, 0, HEAD_GUESS - 1) for i in range(len(keys))])
    if first is None:
        for i in range(len(keys)):
            sink.drop(i, "miss")
        tier._stats.misses += len(keys)
        return
    longer = []
    for i, v in enumerate(first):
        if not v:
            sink.drop(i, "miss")
            tier._stats.misses += 1
            continue
        try:
            hn = SegmentHeader.peek_nbytes(v)
            if hn > len(v):
                longer.append((i, 0, hn - 1))
            else:
                heads[i] = SegmentHeader.decode(v[:hn])
        except SegmentError as e:
            await tier._corrupt(names[i], e)
            sink.drop(i, f"miss: corrupt: {e}")
    for (i, _, _), v in zip(longer, await ranges(longer) or [b""] * len(longer)):
        try:
            heads[i] = SegmentHeader.decode(v)
        except SegmentError as e:
            sink.drop(i, f"tier error: {e}" if not v else f"miss: corrupt: {e}")
    found: list[SegmentHeader | str | None] = []
    for i, h in enumerate(heads):
        if h is not None and h.key != keys[i]:
            await tier._corrupt(names[i], SegmentError("stored segment carries another key"))
            found.append("miss: corrupt: stored segment carries another key")
        else:
            found.append(h)
    live = open_all(sink, found)
    layer = 0
    while live:
        spans = []
        for i in live:
            off, n = heads[i].layers[layer]  # type: ignore[union-attr]
            spans.append((i, off, off + n - 1))
        got = await ranges(spans)
        placed = []
        for i, data in zip(live, got or [b""] * len(live)):
            h = heads[i]
            assert h is not None
            try:
                if got is None:
                    raise ConnectionError("redis unavailable midway")
                sink.into(i, layer)[:] = decode_layer_bytes(h, layer, data)
                tier._stats.bytes_out += len(data)
                placed.append(i)
            except SegmentError as e:  # deleted midway (short), or corrupt
                if len(data) == h.layers[layer][1]:
                    await tier._corrupt(names[i], e)
                sink.drop(i, f"miss: {e}")
            except ConnectionError as e:
                sink.drop(i, f"tier error: {e}")
        if placed:
            await sink.ready(layer)
        layer += 1
        live = [i for i in placed if layer < heads[i].num_layers]  # type: ignore[union-attr]
        tier._stats.hits += len(placed) - len(live)
