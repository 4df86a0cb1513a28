"""The wire framing of segments, shared by server and client.

A segment travels in its one encoding, cut into frames of at most `frame` bytes that
never cross a piece boundary (the header, then each layer), so a receiver can use a layer
the moment its last frame lands. Receivers write frames into one preallocated buffer:
no join of payloads, and nothing is handed on before the whole thing checks out.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from tierkv.cacheserver import wire
from tierkv.cacheserver.wire import Corrupt
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.buffers import out_view
from tierkv.storage_backends.copies import copied
from tierkv.storage_backends.names import KEY_NBYTES
from tierkv.storage_backends.segment import KVSegment, SegmentError, SegmentHeader, decode_layer
from tierkv.storage_backends.sizes import MiB


class BadRequest(Exception):
    """A request the server refuses; carries the gRPC status and a message for the caller."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.code, self.message, self.reason = code, message, reason


def invalid(message: str) -> BadRequest:
    return BadRequest(grpc.StatusCode.INVALID_ARGUMENT, message, "invalid")


def too_big(message: str) -> BadRequest:
    return BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED, message, "limit")


def parser(cls: type[Message]):
    """A deserializer that never raises: grpc would answer UNKNOWN, we answer INVALID_ARGUMENT."""

    def parse(data: bytes) -> Message | Corrupt:
        try:
            return cls.FromString(data)
        except DecodeError:
            return Corrupt(f"not a valid {cls.__name__} message")

    return parse


def check_known(msg: Message | Corrupt | wire.PutFrame) -> None:
    """Refuse unparsable messages and fields this server does not know (a newer or confused
    client)."""
    if isinstance(msg, Corrupt):
        raise invalid(msg.why)
    if isinstance(msg, Message) and len(UnknownFieldSet(msg)):
        raise invalid(f"{type(msg).__name__} carries unknown fields")


def check_keys(keys: Sequence[bytes], max_keys: int) -> list[bytes]:
    if len(keys) > max_keys:
        raise too_big(f"{len(keys)} keys in one request; the limit is {max_keys}")
    for k in keys:
        if len(k) != KEY_NBYTES:
            raise invalid(f"a key is {KEY_NBYTES} bytes, got {len(k)}")
    return list(keys)


def pieces(seg: KVSegment) -> tuple[int, list[memoryview]]:
    """(total length, [header bytes, layer 0, layer 1, ...]) without copying the payload."""
    h, head, blobs = seg.encode_parts()
    return h.nbytes, [memoryview(head)] + [memoryview(b).cast("B") for b in blobs]


def cut(piece: memoryview, frame: int) -> Iterator[memoryview]:
    for off in range(0, len(piece), frame):
        yield piece[off : off + frame]


def _put_parts(
    key: bytes, seg: KVSegment, frame: int
) -> tuple[pb.PutFrame, Iterator[tuple[int, memoryview]]]:
    total, parts = pieces(seg)
    n = sum(-(-len(p) // frame) for p in parts)
    header = pb.PutFrame(seq=0, header=pb.PutHeader(key=key, total_bytes=total, num_frames=n))
    chunks = (c for p in parts for c in cut(p, frame))
    return header, ((seq, c) for seq, c in enumerate(chunks, start=1))


def put_frames(key: bytes, seg: KVSegment, frame: int = MiB) -> Iterator[pb.PutFrame]:
    """The Put stream of seg as messages: a header frame, then payload frames numbered from 1."""
    header, chunks = _put_parts(key, seg, frame)
    yield header
    for seq, c in chunks:
        yield pb.PutFrame(seq=seq, data=bytes(c))


def put_wire(key: bytes, seg: KVSegment, frame: int = MiB) -> Iterator[bytes]:
    """The same stream as put_frames, already serialized (for an identity serializer)."""
    header, chunks = _put_parts(key, seg, frame)
    yield header.SerializeToString()
    for seq, c in chunks:
        yield wire.encode(pb.PutFrame(seq=seq), 3, c)


@dataclass(slots=True)
class Assembly:
    """Client side of Get/GetMany: one segment's LAYER frames into a preallocated buffer.

    Whole mode writes every layer at its place in `dst` (the payload as sent); per-layer
    mode (get_layers) reuses `dst` for each layer in turn, so memory stays one layer.
    """

    header: SegmentHeader
    dst: memoryview
    per_layer: bool
    layer: int = 0  # layer being filled
    filled: int = 0  # bytes of that layer so far

    @staticmethod
    def start(f: wire.SegmentFrame, max_bytes: int, per_layer: bool = False, out=None) -> Assembly:
        """From a HEADER frame. In whole mode an uncompressed payload lands in `out` (a CPU
        tensor or writable buffer) when given, else in a new buffer."""
        if f.kind != pb.SegmentFrame.HEADER:
            raise SegmentError(f"expected a HEADER frame, got kind {f.kind}")
        h = SegmentHeader.decode(f.data)
        if h.nbytes > max_bytes or f.total_bytes != h.nbytes or len(f.data) != h.header_nbytes:
            raise SegmentError(f"segment of {h.nbytes} bytes (frames say {f.total_bytes}) refused")
        size = max(n for _, n in h.layers) if per_layer else h.nbytes - h.header_nbytes
        dst = (
            out_view(out, size) if out is not None and not per_layer and h.codec == "none" else None
        )
        return Assembly(h, dst if dst is not None else memoryview(bytearray(size)), per_layer)

    def _at(self) -> int:
        return (
            0 if self.per_layer else self.header.layers[self.layer][0] - self.header.header_nbytes
        )

    def add(self, f: wire.SegmentFrame) -> int | None:
        """Append a LAYER frame; the layer's index when that layer is now complete."""
        if self.done or f.kind != pb.SegmentFrame.LAYER or f.layer != self.layer:
            raise SegmentError(
                f"unexpected frame (kind {f.kind}, layer {f.layer}) at layer {self.layer}"
            )
        n, data = self.header.layers[self.layer][1], f.data  # one read: each read copies
        if self.filled + len(data) > n:
            raise SegmentError(f"layer {self.layer}: frames exceed its {n} bytes")
        at = self._at() + self.filled
        self.dst[at : at + len(data)] = data
        copied("wire.assemble", len(data))
        self.filled += len(data)
        if self.filled < n:
            return None
        self.layer, self.filled = self.layer + 1, 0
        return self.layer - 1

    def layer_bytes(self, i: int) -> memoryview:
        """Encoded bytes of completed layer i (per-layer mode: only the latest)."""
        at = 0 if self.per_layer else self.header.layers[i][0] - self.header.header_nbytes
        return self.dst[at : at + self.header.layers[i][1]]

    @property
    def done(self) -> bool:
        return self.layer == self.header.num_layers

    def segment(self) -> KVSegment:
        """The whole segment (whole mode, once done), each layer checked against its checksum."""
        h = self.header
        if self.per_layer or not self.done:
            raise SegmentError("segment() needs a complete whole-mode assembly")
        layers = [decode_layer(h, i, self.layer_bytes(i)) for i in range(h.num_layers)]
        if h.codec == "none":  # layers are views of dst, back to back: one view of it all
            dt = layers[0].dtype
            payload = torch.frombuffer(
                self.dst, dtype=dt, count=h.payload_raw_nbytes // dt.itemsize
            )
        else:
            payload = torch.stack(layers)
        seg = KVSegment.of_header(h, payload)
        seg.verified = True  # every layer was checked above
        return seg


async def assemble_many(
    frames: AsyncIterable[wire.SegmentFrame], outs: Sequence[Any], max_bytes: int
) -> list[Assembly | None]:
    """A GetMany stream's segments, each key's frames landing in its `out` where they can;
    None for a key the server missed."""
    asms: list[Assembly | None] = [None] * len(outs)
    async for f in frames:
        if f.index >= len(outs):
            raise SegmentError(f"server answered key index {f.index} of {len(outs)}")
        i, asm = f.index, asms[f.index]
        if f.kind == pb.SegmentFrame.MISS:
            asms[i] = None
        elif asm is None:  # frames land in the caller's `out` when they can
            asms[i] = Assembly.start(f, max_bytes, out=outs[i])
        else:
            asm.add(f)
    return asms
