"""The data plane's TCP port, for engines on other hosts: loads with the payload inline on a
plain socket from a real tierkv-server process, authenticated by the bearer token, isolated
by namespace, refusing malformed input (fuzzed), and off on request or beside TLS."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.dataplane.protocol import (
    BAD_REQUEST,
    GET,
    HEAD,
    HELLO,
    OK,
    PUT,
    RELEASE,
    STREAM,
    UNAUTHENTICATED,
    WELCOME,
    pack,
)
from tierkv.cacheserver.launch import ServerProcess
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.segment import KVSegment

TOKENS = "alpha-token=tenant-a,beta-token=tenant-b"


def segment(key: bytes, seed: int) -> KVSegment:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(4, 2, 64, 2, 64, generator=g).to(torch.bfloat16)
    return KVSegment.from_tensor(kv, key=key, tokens=list(range(64)), fingerprint=b"f" * 16)


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(args=["--tokens", TOKENS]).start()
    yield s
    s.stop(kill=True)


async def tcp_port(target: str, token: str = "alpha-token") -> int:
    t = RemoteTier(target=target, token=token)
    try:
        r = await t.stub.DataPlane(pb.DataPlaneRequest(), **t._opts())
        return int(r.tcp_port)
    finally:
        await t.close()


def tcp(server) -> DataTier:
    return DataTier(target=server.target, token="alpha-token", shared_memory=False)


def test_loads_over_tcp_equal_the_segments(server) -> None:
    async def run() -> None:
        t = tcp(server)
        segs = [segment(bytes([i]) * 16, i) for i in range(12)]
        for s in segs:
            assert await t.put(s.key, s)
        for _ in range(2):  # all at once: one GET, payloads streamed one after another
            got = await asyncio.gather(*(t.get(s.key) for s in segs), t.get(b"\x77" * 16))
            assert got[-1] is None
            for s, g in zip(segs, got):
                assert g is not None and g.verified and torch.equal(g.payload, s.payload)
        assert t._session is not None and t._session.region is None  # TCP, not shared memory
        assert t.stats().errors == 0
        await t.close()

    asyncio.run(run())


def test_namespaces_and_tokens_hold_over_tcp(server) -> None:
    async def run() -> None:
        a = tcp(server)
        b = DataTier(target=server.target, token="beta-token", shared_memory=False)
        secret = segment(b"s" * 16, 1)
        assert await a.put(secret.key, secret)
        assert await b.get(secret.key) is None  # a's key in b's namespace: a miss
        assert b._session is not None
        await a.close()
        await b.close()

    asyncio.run(run())
    port = asyncio.run(tcp_port(server.target))
    with socket.create_connection(("127.0.0.1", port), 10) as sock:
        sock.sendall(pack(HELLO, 0, b"wrong-token"))
        code, _, n = HEAD.unpack(recv(sock, HEAD.size))
        assert code == UNAUTHENTICATED and b"token" in recv(sock, n)


def recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        more = sock.recv(n - len(out))
        if not more:
            break
        out += more
    return out


def session(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), 10)
    sock.sendall(pack(HELLO, 0, b"alpha-token"))
    code, _, n = HEAD.unpack(recv(sock, HEAD.size))
    assert code == OK and len(recv(sock, n)) == WELCOME.size
    return sock


def still_serves(server) -> bool:
    async def run() -> bool:
        t = tcp(server)
        s = segment(b"v" * 16, 5)
        ok = await t.put(s.key, s) and await t.get(s.key) is not None
        ok = ok and t._session is not None and t.stats().errors == 0
        await t.close()
        return bool(ok)

    return asyncio.run(run())


def test_malformed_requests_are_refused(server) -> None:
    port = asyncio.run(tcp_port(server.target))
    cases = [
        pack(99, 0),  # unknown op
        pack(GET, 2, b"k" * 16),  # count and body disagree
        pack(GET, 0),  # no keys
        pack(STREAM, 2, b"k" * 16),  # the same for a stream
        pack(STREAM, 0),
        pack(RELEASE, 1, (0).to_bytes(8, "little")),  # nothing to release over TCP
        HEAD.pack(GET, 1, 1 << 40),  # a body far past the limit
    ]
    for msg in cases:
        with session(port) as sock:
            sock.sendall(msg)
            code, _, n = HEAD.unpack(recv(sock, HEAD.size))
            assert code == BAD_REQUEST and recv(sock, n), msg[:16]
            assert sock.recv(1) == b""  # and the session is closed
    assert still_serves(server)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=200), hello=st.booleans())
def test_fuzzed_bytes_never_break_the_server(server, raw: bytes, hello: bool) -> None:
    port = asyncio.run(tcp_port(server.target))
    sock = session(port) if hello else socket.create_connection(("127.0.0.1", port), 10)
    with sock:
        sock.settimeout(10)
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)  # a truncated request: the server sees the end
            while sock.recv(65536):  # whatever it answers, it closes the session
                pass
        except OSError:  # closed before we were done (a reset, a broken pipe): also a close
            pass


def test_server_survives_the_fuzzing(server) -> None:
    assert still_serves(server)


def test_tcp_port_off_loads_over_grpc() -> None:
    s = ServerProcess(args=["--data-port", "-1"]).start()
    try:

        async def run() -> None:
            assert await tcp_port(s.target) == 0
            t = DataTier(target=s.target, shared_memory=False)
            seg = segment(b"g" * 16, 3)
            assert await t.put(seg.key, seg)
            got = await t.get(seg.key)
            assert got is not None and torch.equal(got.payload, seg.payload)
            assert t._session is None and t.stats().errors == 0
            await t.close()

        asyncio.run(run())
    finally:
        s.stop(kill=True)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["tcp", "unix"])
def test_puts_over_the_data_plane_store_the_segment(server, shared_memory: bool) -> None:
    async def run() -> None:
        t = DataTier(target=server.target, token="alpha-token", shared_memory=shared_memory)
        grpc_tier = RemoteTier(target=server.target, token="alpha-token")
        seg = segment(bytes([40 + shared_memory]) * 16, 9)
        before = await grpc_tier.server_stats()
        assert await t.put(seg.key, seg)
        assert t._session is not None and (t._session.region is not None) == shared_memory
        got = await grpc_tier.get(seg.key)  # stored as it was sent, read back another way
        assert got is not None and torch.equal(got.payload, seg.payload)
        assert await t.get(seg.key) is not None and await t.get(b"\x55" * 16) is None
        after = await grpc_tier.server_stats()  # data plane calls count as gRPC ones do
        assert before is not None and after is not None
        assert (after.puts - before.puts, after.gets - before.gets) == (1, 3)
        assert after.bytes_in - before.bytes_in == seg.nbytes
        assert t.stats().errors == 0
        await t.close()
        await grpc_tier.close()

    asyncio.run(run())


def test_bad_puts_are_refused_and_store_nothing(server) -> None:
    port = asyncio.run(tcp_port(server.target))
    seg = segment(b"p" * 16, 11)
    good = bytes(seg.encode())
    flipped = bytearray(good)
    flipped[-100] ^= 0xFF  # a payload byte: its layer's checksum fails
    cases = {
        "corrupt": (seg.key, bytes(flipped)),
        "other key": (b"o" * 16, good),
        "too big": (seg.key, None),
    }
    for name, (key, data) in cases.items():
        with session(port) as sock:
            size = (1 << 40) if data is None else len(data)
            sock.sendall(pack(PUT, 1, key + size.to_bytes(8, "little")) + (data or b""))
            code, _, n = HEAD.unpack(recv(sock, HEAD.size))
            assert code == BAD_REQUEST and recv(sock, n), name
    with session(port) as sock:  # truncated: the client goes away halfway
        sock.sendall(pack(PUT, 1, seg.key + len(good).to_bytes(8, "little")) + good[:5000])

    async def absent() -> bool:
        t = RemoteTier(target=server.target, token="alpha-token")
        try:
            return (await t.contains([seg.key, b"o" * 16])) == [False, False]
        finally:
            await t.close()

    assert asyncio.run(absent())
    assert still_serves(server)
