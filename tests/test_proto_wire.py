"""The hand-written wire path (cacheserver.wire) agrees with the generated protobuf classes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.cacheserver import wire
from tierkv.proto import tierkv_pb2 as pb

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@given(seq=u32, data=st.binary(min_size=1, max_size=3000))
def test_put_data_frame_round_trip(seq: int, data: bytes) -> None:
    raw = wire.encode(pb.PutFrame(seq=seq), 3, memoryview(data))
    assert raw == pb.PutFrame(seq=seq, data=data).SerializeToString()
    f = wire.parse_put(raw)
    assert (
        isinstance(f, wire.PutFrame) and f.body == "data" and f.seq == seq and bytes(f.data) == data
    )


@given(key=st.binary(max_size=20), total=u64, frames=u32)
def test_put_header_frame(key: bytes, total: int, frames: int) -> None:
    msg = pb.PutFrame(seq=0, header=pb.PutHeader(key=key, total_bytes=total, num_frames=frames))
    f = wire.parse_put(msg.SerializeToString())
    assert f.body == "header" and f.header == msg.header


@given(
    index=u32,
    kind=st.sampled_from([0, 1, 2]),
    layer=u32,
    data=st.binary(max_size=2000),
    total=u64,
    tier=st.text(max_size=8),
)
def test_segment_frame_matches_protobuf(index, kind, layer, data, total, tier) -> None:
    head = pb.SegmentFrame(index=index, kind=kind, layer=layer, total_bytes=total, tier=tier)
    raw = wire.encode(head, 4, memoryview(data))
    ref = pb.SegmentFrame.FromString(raw)
    f = wire.parse_frame(raw)
    assert (f.index, f.kind, f.layer, bytes(f.data), f.total_bytes, f.tier) == (
        ref.index,
        ref.kind,
        ref.layer,
        ref.data,
        ref.total_bytes,
        ref.tier,
    )


@settings(max_examples=300)
@given(raw=st.binary(max_size=64))
def test_garbage_never_raises(raw: bytes) -> None:
    f = wire.parse_put(raw)
    assert isinstance(f, (wire.PutFrame, wire.Corrupt))
    assert isinstance(wire.parse_frame(raw), wire.SegmentFrame)


def test_unknown_and_mistyped_fields_are_named() -> None:
    ok = pb.PutFrame(seq=1, data=b"x").SerializeToString()
    assert "unknown fields" in wire.parse_put(ok + b"\xf8\x07\x01").why
    assert "wire type" in wire.parse_put(b"\x18\x05").why  # field 3 (data) sent as a varint
    hdr = pb.PutHeader(key=b"k").SerializeToString() + b"\xf8\x07\x01"
    assert "PutHeader carries unknown" in wire.parse_put(b"\x12" + bytes([len(hdr)]) + hdr).why
    assert "not a valid" in wire.parse_put(b"\x1a\x10abc").why  # length past the end
    assert wire.parse_frame(b"\x22\x10abc").kind == wire.CORRUPT
