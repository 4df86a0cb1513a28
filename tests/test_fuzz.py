"""Fuzzing the gRPC API of a running tierkv-server: thousands of malformed requests.

Each case goes over loopback as raw bytes (identity serializers), so nothing is filtered on
the client side. Requests have no enum fields; the "unknown enum" analogues are unknown
field numbers and known fields sent with the wrong wire type. Every case checks the exact
status code where one is defined (else one of the refusal codes); afterwards the server is
alive, holds exactly the valid segments (Lookup, Stats, the files of its disk tier), and
its RSS grew by less than RSS_SLACK; the last test checks the total (>= 5,000 cases).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
import torch
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.cacheserver.frames import put_frames
from tierkv.cacheserver.launch import ServerProcess
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.segment import KVSegment

OK, INVALID, EXHAUSTED = (
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
REFUSED = {INVALID, EXHAUSTED}
MAX_KEYS, MAX_FRAMES, MAX_SEG = 32, 64, 1 << 20
RSS_SLACK = 96 << 20  # a 4 MiB receive budget + allocator noise, far below one leak per case
COUNT = {"cases": 0}
ident = lambda b: b


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(
        args=[
            "--max-segment-bytes",
            "1MiB",
            "--max-frames",
            str(MAX_FRAMES),
            "--max-frame-bytes",
            "64KiB",
            "--max-keys",
            str(MAX_KEYS),
            "--max-streams",
            "16",
            "--max-inflight-bytes",
            "4MiB",
            "--cpu-bytes",
            "16MiB",
            "--disk-bytes",
            "64MiB",
        ]
    ).start()
    s.rss0 = psutil.Process(s.proc.pid).memory_info().rss
    s.valid = []  # keys of the valid segments the cases stored
    yield s
    s.stop(kill=True)


@pytest.fixture(scope="module")
def ch(server):
    with grpc.insecure_channel(server.target) as c:
        yield c


def segment(seed: int) -> KVSegment:
    kv = torch.randn(2, 2, 8, 2, 8, generator=torch.Generator().manual_seed(seed)).half()
    return KVSegment.from_tensor(
        kv, key=(seed + 10**6).to_bytes(16, "little"), tokens=range(8), fingerprint=b"f"
    )


def code_of(fn) -> tuple[grpc.StatusCode, object]:
    COUNT["cases"] += 1
    try:
        return OK, fn()
    except grpc.RpcError as e:
        assert e.details(), "a refusal carries a message"
        return e.code(), None


def unary(ch, method: str, stream_out: bool = False):
    path = f"/tierkv.v1.TierKV/{method}"
    if stream_out:
        call = ch.unary_stream(path, request_serializer=ident, response_deserializer=ident)
        return lambda raw: list(call(raw, timeout=10))
    call = ch.unary_unary(path, request_serializer=ident, response_deserializer=ident)
    return lambda raw: call(raw, timeout=10)


def put_call(ch):
    call = ch.stream_unary(
        "/tierkv.v1.TierKV/Put",
        request_serializer=ident,
        response_deserializer=pb.PutResponse.FromString,
    )
    return lambda frames: call(iter(frames), timeout=10)


REQUESTS = {
    "Lookup": pb.LookupRequest,
    "Delete": pb.DeleteRequest,
    "GetMany": pb.GetManyRequest,
    "Get": pb.GetRequest,
    "Stats": pb.StatsRequest,
}


def expected(method: str, raw: bytes) -> grpc.StatusCode:
    """The server's documented answer, from parsing raw the way it does."""
    try:
        msg = REQUESTS[method].FromString(raw)
    except DecodeError:
        return INVALID
    if len(UnknownFieldSet(msg)):
        return INVALID
    keys = [msg.key] if method == "Get" else list(getattr(msg, "keys", []))
    if len(keys) > MAX_KEYS:
        return EXHAUSTED
    return INVALID if any(len(k) != 16 for k in keys) else OK


def random_request(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.4:  # garbage
        return rng.randbytes(rng.choice([0, 1, 2, 5, 17, 64, 300]))
    keys = [
        rng.randbytes(rng.choice([0, 1, 15, 16, 16, 16, 17, 100]))
        for _ in range(rng.choice([0, 1, 3, 33, 40]))
    ]
    raw = pb.LookupRequest(
        keys=keys
    ).SerializeToString()  # field 1, bytes: the same in every keyed request
    if kind < 0.55:  # unknown field numbers / a known field with the wrong wire type
        raw += rng.choice(
            [b"\xf8\x07\x01", b"\x08\x01", b"\x10\x05", b"\x0d\x00\x00\x00\x00", b"\x1a\x00"]
        )
    elif kind < 0.7 and raw:  # cut short or a flipped byte
        raw = raw[: rng.randrange(len(raw))] if rng.random() < 0.5 else _flip(raw, rng)
    return raw


def _flip(raw: bytes, rng: random.Random) -> bytes:
    b = bytearray(raw)
    b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def test_unary_requests(ch) -> None:
    """3,000 generated requests over the five request types: exactly the documented code."""
    rng = random.Random(8)
    calls = {m: unary(ch, m, stream_out=m in ("Get", "GetMany")) for m in REQUESTS}
    seen = {OK: 0, INVALID: 0, EXHAUSTED: 0}
    for i in range(3000):
        method = list(REQUESTS)[i % len(REQUESTS)]
        raw = random_request(rng)
        if method == "Get":  # GetRequest.key is field 1 too, but singular: one key
            raw = (
                pb.GetRequest(key=rng.randbytes(rng.choice([0, 16, 16, 17]))).SerializeToString()
                if rng.random() < 0.5
                else raw
            )
        code, out = code_of(lambda: calls[method](raw))
        assert code == expected(method, raw), (method, raw[:40])
        seen[code] += 1
        if code == OK and method in (
            "Get",
            "GetMany",
        ):  # random keys are never present: one MISS each
            assert all(pb.SegmentFrame.FromString(f).kind == pb.SegmentFrame.MISS for f in out)
    assert min(seen.values()) > 100, seen  # every outcome exercised


MUTATIONS = [
    "swap",
    "drop",
    "dup",
    "seq",
    "total",
    "huge total",
    "frames",
    "huge frames",
    "key len",
    "empty key",
    "huge key",
    "flip",
    "cut data",
    "garbage frame",
    "unknown field",
    "data first",
    "empty",
    "zero total",
]


def mutate(
    frames: list[bytes], msgs: list[pb.PutFrame], m: str, rng: random.Random
) -> tuple[list[bytes], set]:
    """One mutation of a valid Put stream and the codes it may get."""
    f, h = list(frames), pb.PutHeader()
    h.CopyFrom(msgs[0].header)

    def header(**kw) -> bytes:
        for k, v in kw.items():
            setattr(h, k, v)
        return pb.PutFrame(seq=0, header=h).SerializeToString()

    n = len(f)
    if m == "swap":
        i = rng.randrange(1, n - 1)
        f[i], f[i + 1] = f[i + 1], f[i]
    elif m == "drop":
        del f[rng.randrange(1, n)]
    elif m == "dup":
        i = rng.randrange(n)
        f.insert(i, f[i])
    elif m == "seq":
        i = rng.randrange(1, n)
        f[i] = pb.PutFrame(
            seq=msgs[i].seq + rng.choice([1, 2, 1000]), data=msgs[i].data
        ).SerializeToString()
    elif m == "total":
        f[0] = header(total_bytes=h.total_bytes + rng.choice([-100, -1, 1, 100]))
    elif m == "huge total":
        f[0] = header(total_bytes=rng.choice([MAX_SEG + 1, 1 << 40, (1 << 64) - 1]))
        return f, {EXHAUSTED}
    elif m == "frames":
        f[0] = header(num_frames=h.num_frames + rng.choice([-1, 1, 5]))
    elif m == "huge frames":
        f[0] = header(num_frames=rng.choice([MAX_FRAMES + 1, (1 << 32) - 1]))
        return f, {EXHAUSTED}
    elif m in ("key len", "empty key", "huge key"):
        f[0] = header(
            key={
                "key len": rng.randbytes(rng.choice([1, 15, 17, 32])),
                "empty key": b"",
                "huge key": rng.randbytes(60 << 10),
            }[m]
        )
    elif m == "flip":
        i = rng.randrange(1, n)
        f[i] = pb.PutFrame(seq=msgs[i].seq, data=_flip(msgs[i].data, rng)).SerializeToString()
    elif m == "cut data":
        i = rng.randrange(1, n)
        f[i] = pb.PutFrame(
            seq=msgs[i].seq, data=msgs[i].data[: rng.randrange(len(msgs[i].data))]
        ).SerializeToString()
    elif m == "garbage frame":
        f.insert(rng.randrange(n + 1), rng.randbytes(rng.choice([1, 3, 40, 500])))
    elif m == "unknown field":
        i = rng.randrange(n)
        f[i] += rng.choice(
            [b"\xf8\x07\x01", b"\x0a\x00"]
        )  # field 127; seq as bytes (wrong wire type)
    elif m == "data first":
        f = f[1:]
    elif m == "empty":
        f = []
    elif m == "zero total":
        f[0] = header(total_bytes=0) if rng.random() < 0.5 else header(num_frames=0)
    return f, {INVALID}


def test_put_streams(server, ch) -> None:
    """2,400 mutated Put streams from 4 threads: each refused with its code, none stored;
    every 8th stream is sent unmutated and must be stored."""
    put = put_call(ch)
    rng = random.Random(88)
    cases = []
    for i in range(2400):
        s = segment(i)
        msgs = list(put_frames(s.key, s, 256))
        frames = [m.SerializeToString() for m in msgs]
        if i % 8 == 0:
            cases.append((s.key, frames, {OK}))
            continue
        m = MUTATIONS[i % len(MUTATIONS)]
        fs, codes = mutate(frames, msgs, m, rng)
        for _ in range(rng.choice([0, 0, 1])):  # sometimes a second mutation on top
            if len(fs) > 2:  # frame-level only: fs no longer lines up with msgs
                fs = mutate(fs, msgs, rng.choice(["swap", "unknown field", "dup"]), rng)[0]
            codes = REFUSED
        cases.append((s.key, fs, {OK} if fs == frames else codes))  # a swap undone by a swap

    def run(case) -> tuple[bytes, grpc.StatusCode, set]:
        key, fs, codes = case
        code, r = code_of(lambda: put(fs))
        assert code != OK or r.stored
        return key, code, codes

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, cases))
    for _key, code, codes in results:
        assert code in codes, (code, codes)
    server.valid += [k for k, _, codes in results if codes == {OK}]
    assert_only_valid_stored(server, ch, [k for k, _, _ in results])


@settings(
    max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)
@given(
    key=st.binary(max_size=40),
    total=st.integers(0, 2**64 - 1),
    nframes=st.integers(0, 2**32 - 1),
    body=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=300)), max_size=6),
    header_first=st.booleans(),
)
def test_hypothesis_put_headers(server, ch, key, total, nframes, body, header_first) -> None:
    """Arbitrary header fields and data frames: never stored (nothing decodes to a segment),
    and huge declared sizes are RESOURCE_EXHAUSTED before any allocation."""
    frames = [pb.PutFrame(seq=s, data=d).SerializeToString() for s, d in body]
    head = pb.PutFrame(
        seq=0, header=pb.PutHeader(key=key, total_bytes=total, num_frames=nframes)
    ).SerializeToString()
    code, _ = code_of(lambda: put_call(ch)([head, *frames] if header_first else [*frames, head]))
    assert code in REFUSED
    if header_first and len(key) == 16 and total > MAX_SEG and nframes > 0:
        assert code == EXHAUSTED


@settings(
    max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)
@given(method=st.sampled_from(list(REQUESTS)), raw=st.binary(max_size=200))
def test_hypothesis_unary_bytes(ch, method: str, raw: bytes) -> None:
    code, _ = code_of(lambda: unary(ch, method, method in ("Get", "GetMany"))(raw))
    assert code == expected(method, raw)


def assert_only_valid_stored(server, ch, keys: list[bytes]) -> None:
    lookup = ch.unary_unary(
        "/tierkv.v1.TierKV/Lookup",
        request_serializer=pb.LookupRequest.SerializeToString,
        response_deserializer=pb.LookupResponse.FromString,
    )
    valid, present = set(server.valid), []
    for i in range(0, len(keys), MAX_KEYS):
        part = keys[i : i + MAX_KEYS]
        present += [k for k, p in zip(part, lookup(pb.LookupRequest(keys=part)).present) if p]
    # Only valid puts are present. Not every one of them: under this load the store's bounded
    # write-behind queue drops some copies by design (a cache may forget, never invent).
    assert set(present) <= valid and len(present) >= len(valid) // 2, (len(present), len(valid))


def test_server_survived_and_memory_bounded(server, ch) -> None:
    """Runs last: alive, exactly the valid segments in the store and on disk, RSS bounded."""
    import time

    assert server.proc.poll() is None
    assert len(server.valid) >= 300
    time.sleep(0.5)  # the write-behind queue reaches the disk tier
    files = {p.name for p in (server.cache_dir / "disk").rglob("*") if p.is_file()}
    assert files and files <= {
        f"{k.hex()}.tkv" for k in server.valid
    }  # no refused, partial or temp file
    stats = ch.unary_unary(
        "/tierkv.v1.TierKV/Stats",
        request_serializer=pb.StatsRequest.SerializeToString,
        response_deserializer=pb.StatsResponse.FromString,
    )(pb.StatsRequest())
    assert {t.name: t.count for t in stats.tiers}["disk"] == len(files) and stats.puts == len(
        server.valid
    )
    grew = psutil.Process(server.proc.pid).memory_info().rss - server.rss0
    assert grew < RSS_SLACK, f"server RSS grew by {grew >> 20} MiB over the fuzz run"
    assert COUNT["cases"] >= 5000, COUNT
