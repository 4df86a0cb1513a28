"""The server side of Put: a whole stream into one buffer, checked, then decoded.

Nothing reaches the store before the last frame arrived in order, the length matches the
header, the segment decodes, every layer checksum holds and its key is the header's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from tierkv.cacheserver.frames import KEY_NBYTES, check_known, invalid, too_big
from tierkv.cacheserver.wire import Corrupt, PutFrame
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.segment import KVSegment, SegmentError


@dataclass(slots=True)
class PutLimits:
    max_segment_bytes: int
    max_frame_bytes: int
    max_frames: int


@dataclass(slots=True)
class Inflight:
    """The server-wide budget of bytes held by Puts still being received. Safety: memory is
    taken as bytes arrive, never from a size a client declares; a frame that would take the
    total past `limit` fails its Put with RESOURCE_EXHAUSTED and the Put's bytes are given back.
    Not thread-safe: used from the server's one event loop."""

    limit: int
    used: int = 0
    peak: int = 0

    def take(self, n: int) -> None:
        if self.used + n > self.limit:
            raise too_big(
                f"server receive budget exhausted: {self.used} of max_inflight_bytes "
                f"{self.limit} held by Puts in flight; retry later"
            )
        self.used += n
        self.peak = max(self.peak, self.used)

    def give(self, n: int) -> None:
        self.used -= n


async def receive_put(
    frames: AsyncIterator[PutFrame | Corrupt], lim: PutLimits, inflight: Inflight
) -> tuple[bytes, KVSegment, int]:
    """Read a whole Put stream into a buffer that grows as the bytes arrive, and decode it (the
    segment views the buffer); returns the bytes taken from `inflight`, to give back once
    stored. BadRequest on anything off, with the budget given back."""
    got = await anext(frames, None)
    if got is None:
        raise invalid("empty Put stream: expected a header frame")
    first = _known(got)
    h = first.header
    if h is None or first.seq != 0:
        raise invalid("the first Put frame must be the header, seq 0")
    if len(h.key) != KEY_NBYTES:
        raise invalid(f"a key is {KEY_NBYTES} bytes, got {len(h.key)}")
    if h.total_bytes == 0 or h.num_frames == 0:
        raise invalid("a Put needs total_bytes > 0 and num_frames > 0")
    if h.total_bytes > lim.max_segment_bytes:
        raise too_big(
            f"segment of {h.total_bytes} bytes exceeds max_segment_bytes {lim.max_segment_bytes}"
        )
    if h.num_frames > lim.max_frames:
        raise too_big(f"{h.num_frames} frames exceed max_frames {lim.max_frames}")
    if h.num_frames > h.total_bytes:
        raise invalid(f"{h.num_frames} frames cannot carry {h.total_bytes} bytes")
    buf = bytearray()
    try:
        seg = await _fill(frames, h, lim, buf, inflight)
    except BaseException:
        inflight.give(len(buf))  # nothing refers to it: the segment never left this function
        raise
    return h.key, seg, len(buf)


def _known(f: PutFrame | Corrupt) -> PutFrame:
    """f, unless it did not parse (then refused with the reason)."""
    if isinstance(f, Corrupt):
        raise invalid(f.why)
    check_known(f)
    return f


async def _fill(
    frames: AsyncIterator[PutFrame | Corrupt],
    h: pb.PutHeader,
    lim: PutLimits,
    buf: bytearray,
    inflight: Inflight,
) -> KVSegment:
    pos = 0
    for seq in range(1, h.num_frames + 1):
        got = await anext(frames, None)
        if got is None:
            raise invalid(f"truncated Put: stream ended after {seq - 1} of {h.num_frames} frames")
        f = _known(got)
        data = f.data  # a view of the received bytes: copied once, into mv
        if data is None or f.body != "data" or f.seq != seq:
            raise invalid(
                f"frame out of order: expected data frame {seq}, got {f.body} frame {f.seq}"
            )
        n = len(data)
        if n > lim.max_frame_bytes:
            raise too_big(f"frame {seq} has {n} bytes; max_frame_bytes is {lim.max_frame_bytes}")
        if n == 0 or pos + n > h.total_bytes:
            raise invalid(
                f"frame {seq} ({n} bytes) does not fit the header's total_bytes {h.total_bytes}"
            )
        inflight.take(n)
        buf += data  # grows in place (realloc): each byte is copied once, as it arrives
        copied("server.receive", n)
        pos += n
    if await anext(frames, None) is not None:
        raise invalid(f"more frames than the header's num_frames {h.num_frames}")
    if pos != h.total_bytes:
        raise invalid(f"payload is {pos} bytes, the header says {h.total_bytes}")
    try:
        seg = KVSegment.decode(memoryview(buf), verify=True)
    except SegmentError as e:
        raise invalid(f"malformed segment: {e}") from None
    if seg.key != h.key:
        raise invalid("the segment's own key differs from the Put header's key")
    return seg
