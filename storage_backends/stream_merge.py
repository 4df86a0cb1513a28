"""One stream out of several tiers' streams (Merge, merged_stream), and what a store promotes
from it (Keep).

A tiered store streams each key from the fastest tier holding it, every tier's share at once;
Merge makes layer l ready to the reader once every tier's part has reached it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.header import SegmentHeader
from tierkv.storage_backends.segment import KVSegment
from tierkv.storage_backends.stream import LayerSink, reader_checks

if TYPE_CHECKING:
    from tierkv.storage_backends.tier import Tier


@dataclass(slots=True, eq=False)
class Merge:
    """Several sub-streams (one per tier) into one sink: layer l is made ready once every
    sub-stream has reached it or ended, and each sub-stream waits for that before going on."""

    sink: LayerSink
    parts: int
    reached: list[float] = field(default_factory=list)  # per part: last layer ready, inf: ended
    top: int = -1  # the highest layer any part reached
    emitted: int = -1
    flushing: asyncio.Lock = field(default_factory=asyncio.Lock)
    emitted_up: asyncio.Condition | None = None
    failed: BaseException | None = None  # what the sink's ready raised, once it did

    def __post_init__(self) -> None:
        self.reached = [-1.0] * self.parts
        self.emitted_up = asyncio.Condition(self.flushing)

    def part(self, j: int, index: list[int]) -> _Part:
        return _Part(self, j, index)

    async def reach(self, j: int, layer: float) -> None:
        """Part j made `layer` ready (inf: it ended); returns once the merged stream has made it
        ready. An exception of the sink's ready reaches every part waiting."""
        self.reached[j] = layer
        if not math.isinf(layer):
            self.top = max(self.top, int(layer))
        cond = self.emitted_up
        assert cond is not None
        async with cond:
            try:
                while self.failed is None and self.emitted < min(min(self.reached), self.top):
                    self.emitted += 1
                    await self.sink.ready(self.emitted)
                    cond.notify_all()
            except BaseException as e:
                self.failed = e
                cond.notify_all()
                raise
            if not math.isinf(layer):
                await cond.wait_for(lambda: self.failed is not None or self.emitted >= layer)
                if self.failed is not None:
                    raise self.failed


@dataclass(slots=True, eq=False)
class _Part:
    """One sub-stream's sink: its key indexes mapped back to the whole stream's."""

    merge: Merge
    j: int
    index: list[int]

    @property
    def checks(self) -> bool:
        return reader_checks(self.merge.sink)

    def open(self, i: int, header: SegmentHeader) -> bool:
        return self.merge.sink.open(self.index[i], header)

    def into(self, i: int, layer: int) -> memoryview:
        return self.merge.sink.into(self.index[i], layer)

    def drop(self, i: int, why: str) -> None:
        self.merge.sink.drop(self.index[i], why)

    async def ready(self, layer: int) -> None:
        await self.merge.reach(self.j, layer)

    async def end(self) -> None:
        await self.merge.reach(self.j, math.inf)


@dataclass(slots=True, eq=False)
class Keep:
    """A sink in front of another that remembers where each key's layers went, so that the
    whole segments can be copied afterwards (a store promotes streamed hits from them)."""

    sink: LayerSink
    heads: dict[int, SegmentHeader] = field(default_factory=dict)
    views: dict[int, list[memoryview]] = field(default_factory=dict)

    @property
    def checks(self) -> bool:
        return reader_checks(self.sink)

    def open(self, i: int, header: SegmentHeader) -> bool:
        if not self.sink.open(i, header):
            return False
        self.heads[i], self.views[i] = header, []
        return True

    def into(self, i: int, layer: int) -> memoryview:
        view = self.sink.into(i, layer)
        self.views[i].append(view)
        return view

    def drop(self, i: int, why: str) -> None:
        self.heads.pop(i, None)
        self.sink.drop(i, why)

    async def ready(self, layer: int) -> None:
        await self.sink.ready(layer)

    def complete(self) -> list[int]:
        """The keys delivered whole."""
        return [i for i, h in self.heads.items() if len(self.views[i]) == h.num_layers]

    def whole(self) -> list[tuple[int, KVSegment]]:
        """(key index, an owned copy) of each key delivered whole; call before the sink reuses
        its buffers."""
        out = []
        for i in self.complete():
            h = self.heads[i]
            buf = torch.empty(h.payload_raw_nbytes, dtype=torch.uint8).numpy().data
            n = h.layer_raw_nbytes
            for layer, view in enumerate(self.views[i]):
                buf[layer * n : (layer + 1) * n] = view
            copied("store.keep", h.payload_raw_nbytes)
            seg = KVSegment.from_raw(h, buf, verify=False)
            seg.owned = True
            out.append((i, seg))
        return out


async def merged_stream(
    tiers: Sequence[Tier],
    where: list[int | None],
    keys: Sequence[bytes],
    ns: str,
    sink: LayerSink,
    promote: Callable[[bytes, KVSegment, str, int, None], Awaitable[None]] | None,
) -> int:
    """Each key streamed from tiers[where[i]] (None: dropped as a miss), every tier's share at
    once, merged layer by layer into sink; with promote, each whole hit of a slower tier goes
    to promote(key, segment, ns, tier index, None). Returns how many keys arrived complete."""
    groups: dict[int, list[int]] = {}
    for i, w in enumerate(where):
        if w is None:
            sink.drop(i, "miss")
        else:
            groups.setdefault(w, []).append(i)
    merge = Merge(sink, len(groups))
    hits = 0

    async def run(j: int, t: int, index: list[int]) -> None:
        nonlocal hits
        part = merge.part(j, index)
        keep = Keep(part)
        try:
            await tiers[t].stream([keys[i] for i in index], ns, keep)
        finally:
            await part.end()
        hits += len(keep.complete())
        if promote is not None and t:
            for k, seg in keep.whole():
                await promote(keys[index[k]], seg, ns, t, None)

    # Every part runs to its end before an error is raised: none may write into the sink's
    # buffers after this returns.
    done = await asyncio.gather(
        *(run(j, t, idx) for j, (t, idx) in enumerate(groups.items())),
        return_exceptions=True,
    )
    errors = [e for e in done if isinstance(e, BaseException)]
    if errors:
        raise errors[0]
    return hits
