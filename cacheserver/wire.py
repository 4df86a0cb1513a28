"""Protobuf wire bytes of the big frames, written and read without the message classes.

A 1 MiB frame through the generated classes is copied three times (parse into the
message, read the field out, copy to its place). Here the payload goes straight from the
received bytes to its destination, and out of its source into the sent bytes, once.
Only PutFrame and SegmentFrame take this path; every other message uses tierkv_pb2.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.copies import copied

VARINT, LEN = 0, 2
CORRUPT = -1  # SegmentFrame.kind of a frame that did not parse


def identity(b: bytes) -> bytes:
    """The (de)serializer of bytes that are already wire bytes: pre-serialized frames."""
    return b


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode(head: Message, field: int, data: memoryview) -> bytes:
    """head's wire bytes plus bytes field `field` = data (one copy of data)."""
    copied("wire.frame", len(data))
    return b"".join((head.SerializeToString(), varint(field << 3 | LEN), varint(len(data)), data))


def _read_varint(mv: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(mv) or shift > 63:
            raise DecodeError("truncated or overlong varint")
        b = mv[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not b & 0x80:
            return value, pos


def fields(raw: bytes) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field: an int for a VARINT, else a view of raw."""
    mv, pos = memoryview(raw), 0
    val: int | memoryview
    while pos < len(mv):
        key, pos = _read_varint(mv, pos)
        num, wt = key >> 3, key & 7
        if num == 0:
            raise DecodeError("field number 0")
        if wt == VARINT:
            val, pos = _read_varint(mv, pos)
        elif wt == LEN:
            n, pos = _read_varint(mv, pos)
            if pos + n > len(mv):
                raise DecodeError("length runs past the end")
            val, pos = mv[pos : pos + n], pos + n
        elif wt in (1, 5):  # fixed64 / fixed32: none in our messages, but well-formed
            size = 8 if wt == 1 else 4
            if pos + size > len(mv):
                raise DecodeError("truncated fixed field")
            val, pos = mv[pos : pos + size], pos + size
        else:
            raise DecodeError(f"wire type {wt}")
        yield num, wt, val


def _view(val: int | memoryview) -> memoryview:
    """The bytes of a LEN field (fields() gives a view for every wire type but VARINT)."""
    if isinstance(val, int):
        raise DecodeError("expected a length-delimited field")
    return val


@dataclass(slots=True)
class Corrupt:
    """Stands in for a request that did not parse, so the handler can refuse it with `why`."""

    why: str


@dataclass(slots=True)
class PutFrame:
    seq: int = 0
    header: pb.PutHeader | None = None
    data: memoryview | None = None  # a view of the received bytes

    @property
    def body(self) -> str | None:
        return "header" if self.header is not None else "data" if self.data is not None else None


def parse_put(raw: bytes) -> PutFrame | Corrupt:
    """A PutFrame, or Corrupt naming what is wrong (never raises: gRPC would say UNKNOWN)."""
    f = PutFrame()
    try:
        for num, wt, val in fields(raw):
            if num == 1 and isinstance(val, int):
                f.seq = val
            elif num == 2 and wt == LEN:  # oneof: the last one wins; a header is small (copied)
                f.header, f.data = pb.PutHeader.FromString(bytes(_view(val))), None
                if len(UnknownFieldSet(f.header)):
                    return Corrupt("PutHeader carries unknown fields")
            elif num == 3 and wt == LEN:
                f.data, f.header = _view(val), None
            elif num in (1, 2, 3):
                return Corrupt(f"not a valid PutFrame message (field {num} has wire type {wt})")
            else:
                return Corrupt("PutFrame carries unknown fields")
    except DecodeError as e:
        return Corrupt(f"not a valid PutFrame message ({e})")
    return f


@dataclass(slots=True)
class SegmentFrame:
    index: int = 0
    kind: int = pb.SegmentFrame.HEADER
    layer: int = 0
    data: memoryview = memoryview(b"")
    total_bytes: int = 0
    tier: str = ""


def parse_frame(raw: bytes) -> SegmentFrame:
    """A SegmentFrame (client side; unknown fields from a newer server are skipped). Never
    raises: a frame that does not parse gets kind CORRUPT, which every reader refuses."""
    f = SegmentFrame()
    try:
        for num, wt, val in fields(raw):
            if wt == VARINT and num in (1, 2, 3, 5):
                setattr(f, ("index", "kind", "layer", "", "total_bytes")[num - 1], val)
            elif wt == LEN and num == 4:
                f.data = _view(val)
            elif wt == LEN and num == 6:
                f.tier = bytes(val).decode(errors="replace")
    except DecodeError:
        f.kind = CORRUPT
    return f
