"""Every refused request: right status, a message, nothing stored, and the server keeps serving."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
import torch

from tierkv.cacheserver.frames import put_frames
from tierkv.cacheserver.launch import ServerProcess
from tierkv.proto import tierkv_pb2 as pb
from tierkv.proto import tierkv_pb2_grpc as pb_grpc
from tierkv.storage_backends.segment import KVSegment

INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
UNKNOWN_FIELD = b"\xf8\x07\x01"  # field 127, varint 1: no message of tierkv.v1 has it


def segment(seed: int, layers: int = 3, tokens: int = 64) -> KVSegment:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, tokens, 2, 32, generator=g).to(torch.float16)
    return KVSegment.from_tensor(
        kv, key=seed.to_bytes(16, "little"), tokens=list(range(tokens)), fingerprint=b"t"
    )


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(
        args=[
            "--max-segment-bytes",
            "1MiB",
            "--max-frames",
            "64",
            "--max-frame-bytes",
            "64KiB",
            "--max-keys",
            "32",
            "--max-streams",
            "2",
        ]
    ).start()
    yield s
    s.stop(kill=True)


@pytest.fixture
def ch(server):
    with grpc.insecure_channel(server.target) as c:
        yield c


def frames(seg: KVSegment, frame: int = 16 << 10) -> list[pb.PutFrame]:
    return list(put_frames(seg.key, seg, frame))


def refused(fn, code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == code, e.value.details()
    assert words in e.value.details(), e.value.details()


def stored(ch, key: bytes) -> bool:
    return pb_grpc.TierKVStub(ch).Lookup(pb.LookupRequest(keys=[key])).present[0]


def still_serving(ch) -> None:
    s = segment(999)
    stub = pb_grpc.TierKVStub(ch)
    assert stub.Put(iter(frames(s))).stored and stored(ch, s.key)
    assert stub.Delete(pb.DeleteRequest(keys=[s.key])).deleted == [True]


def put(ch, fs) -> pb.PutResponse:
    return pb_grpc.TierKVStub(ch).Put(iter(fs), timeout=30)


BAD_PUTS = {
    "out of order": (lambda f: [f[0], f[2], f[1], *f[3:]], INVALID, "out of order"),
    "missing header": (lambda f: f[1:], INVALID, "must be the header"),
    "two headers": (lambda f: [f[0], f[0], *f[1:]], INVALID, "out of order"),
    "truncated": (lambda f: f[:-2], INVALID, "truncated"),
    "extra frame": (lambda f: [*f, f[-1]], INVALID, "more frames"),
    "empty stream": (lambda f: [], INVALID, "empty Put"),
    "total too small": (
        lambda f: [_hdr(f[0], total=f[0].header.total_bytes - 1), *f[1:]],
        INVALID,
        "does not fit",
    ),
    "total too large": (
        lambda f: [_hdr(f[0], total=f[0].header.total_bytes + 1), *f[1:]],
        INVALID,
        "payload is",
    ),
    "key mismatch": (lambda f: [_hdr(f[0], key=bytes(16)), *f[1:]], INVALID, "differs"),
    "short key": (lambda f: [_hdr(f[0], key=b"abc"), *f[1:]], INVALID, "16 bytes"),
    "flipped byte": (
        lambda f: [*f[:-1], _data(f[-1], bytes([f[-1].data[0] ^ 1]) + f[-1].data[1:])],
        INVALID,
        "checksum",
    ),
    "garbage payload": (
        lambda f: [f[0], *[_data(x, b"\x00" * len(x.data)) for x in f[1:]]],
        INVALID,
        "malformed",
    ),
    "oversized segment": (
        lambda f: [_hdr(f[0], total=2 << 20), *f[1:]],
        EXHAUSTED,
        "max_segment_bytes",
    ),
    "too many frames": (lambda f: [_hdr(f[0], frames=65), *f[1:]], EXHAUSTED, "max_frames"),
}


def _hdr(
    f: pb.PutFrame, key: bytes | None = None, total: int | None = None, frames: int | None = None
) -> pb.PutFrame:
    h = pb.PutHeader()
    h.CopyFrom(f.header)
    if key is not None:
        h.key = key
    if total is not None:
        h.total_bytes = total
    if frames is not None:
        h.num_frames = frames
    return pb.PutFrame(seq=0, header=h)


def _data(f: pb.PutFrame, data: bytes) -> pb.PutFrame:
    return pb.PutFrame(seq=f.seq, data=data)


@pytest.mark.parametrize("case", list(BAD_PUTS))
def test_bad_put(ch, case: str) -> None:
    s = segment(hash(case) % 1000 + 1)
    mutate, code, words = BAD_PUTS[case]
    refused(lambda: put(ch, mutate(frames(s))), code, words)
    assert not stored(ch, s.key)
    still_serving(ch)


def test_frame_over_limit(ch) -> None:
    s = segment(1001, tokens=1024)  # 256 KiB layers: a 128 KiB frame fits no limit
    refused(lambda: put(ch, frames(s, frame=96 << 10)), EXHAUSTED, "max_frame_bytes")
    # Far beyond: gRPC's own message limit (set from max_frame_bytes) refuses it first.
    refused(lambda: put(ch, frames(s, frame=256 << 10)), EXHAUSTED, "larger than max")
    assert not stored(ch, s.key)


def _raw(ch, method: str, stream: bool):
    ident = lambda b: b
    path = f"/tierkv.v1.TierKV/{method}"
    if stream:
        return ch.stream_unary(
            path, request_serializer=ident, response_deserializer=pb.PutResponse.FromString
        )
    return ch.unary_unary(path, request_serializer=ident, response_deserializer=ident)


def test_unknown_fields(ch) -> None:
    s = segment(1002)
    fs = [f.SerializeToString() for f in frames(s)]
    refused(
        lambda: _raw(ch, "Put", True)(iter([fs[0] + UNKNOWN_FIELD, *fs[1:]])),
        INVALID,
        "unknown fields",
    )
    refused(
        lambda: _raw(ch, "Put", True)(iter([*fs[:2], fs[2] + UNKNOWN_FIELD, *fs[3:]])),
        INVALID,
        "unknown",
    )
    hdr = pb.PutHeader(key=s.key, total_bytes=1, num_frames=1).SerializeToString() + UNKNOWN_FIELD
    nested = b"\x12" + bytes([len(hdr)]) + hdr  # PutFrame.header with an unknown field inside
    refused(lambda: _raw(ch, "Put", True)(iter([nested])), INVALID, "PutHeader carries unknown")
    req = pb.LookupRequest(keys=[s.key]).SerializeToString() + UNKNOWN_FIELD
    refused(lambda: _raw(ch, "Lookup", False)(req), INVALID, "unknown fields")
    refused(
        lambda: _raw(ch, "Lookup", False)(b"\xff\xff\xff"), INVALID, "not a valid LookupRequest"
    )
    refused(
        lambda: _raw(ch, "Put", True)(iter([fs[0], b"\xff\xff"])), INVALID, "not a valid PutFrame"
    )
    assert not stored(ch, s.key)
    still_serving(ch)


def test_bad_keys_and_too_many_keys(ch) -> None:
    stub = pb_grpc.TierKVStub(ch)
    refused(lambda: stub.Lookup(pb.LookupRequest(keys=[b"short"])), INVALID, "16 bytes")
    refused(lambda: stub.Lookup(pb.LookupRequest(keys=[bytes(16)] * 33)), EXHAUSTED, "limit is 32")
    refused(
        lambda: list(stub.GetMany(pb.GetManyRequest(keys=[bytes(16)] * 33))),
        EXHAUSTED,
        "limit is 32",
    )
    refused(lambda: list(stub.Get(pb.GetRequest(key=b"x" * 17))), INVALID, "16 bytes")
    refused(lambda: stub.Delete(pb.DeleteRequest(keys=[b""])), INVALID, "16 bytes")
    still_serving(ch)


def test_concurrent_stream_limit(ch) -> None:
    """Two stalled Puts hold both stream slots; a third is refused; they end, slots free up."""
    gates = [threading.Event(), threading.Event()]
    results: list[object] = [None, None]

    def stalled(i: int) -> None:
        s = segment(2000 + i)
        fs = frames(s)

        def gen() -> Iterator[pb.PutFrame]:
            yield fs[0]
            gates[i].wait(30)
            yield from fs[1:]

        results[i] = put(ch, gen())

    threads = [threading.Thread(target=stalled, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    s = segment(2002)
    try:
        _wait_refused(ch, s)
    finally:
        for g in gates:
            g.set()
        for t in threads:
            t.join(30)
    assert all(r.stored for r in results)
    still_serving(ch)


def _wait_refused(ch, s: KVSegment) -> None:
    import time

    time.sleep(2.0)  # the stalled streams reach the server first (else one of them is refused)
    with pytest.raises(grpc.RpcError) as e:
        put(ch, frames(s))
    assert e.value.code() == EXHAUSTED and "max_streams" in e.value.details()
    assert not stored(ch, s.key)
