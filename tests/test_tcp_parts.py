"""GET_PART on the wire, against a real tierkv-server process: bad parts are refused with
nothing changed (hypothesis), a client killed mid-part frees the pages its send held, and
striped loads over TLS are whole."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_server_auth import self_signed
from tests.test_tcp_stripes import Collect, key, raw, segment
from tierkv.cacheserver.dataplane.client import DataTier
from tierkv.cacheserver.dataplane.protocol import (
    BAD_REQUEST,
    GET_PART,
    HEAD,
    HELLO,
    OK,
    PART,
    WELCOME,
    pack,
)
from tierkv.cacheserver.launch import ServerProcess
from tierkv.storage_backends.segment import KVSegment


def test_stripes_over_tls_return_the_stored_bytes(tmp_path) -> None:
    """Under TLS every stripe is a TLS session; its receives and the server's sends stay on the
    event loops (records are made there), and the loads are whole."""
    cert, tls_key = self_signed(tmp_path)
    args = ["--tls-cert", str(cert), "--tls-key", str(tls_key), "--cpu-bytes", "256MiB"]
    server = ServerProcess(args=args).start()

    async def run() -> None:
        t = DataTier(
            target=server.target,
            tls_ca=str(cert),
            shared_memory=False,
            stripes=3,
            stripe_min_bytes=1,
        )
        try:
            segs = [segment(k, 8, 1024) for k in range(5)]
            for x in segs:
                assert await t.put(x.key, x)
            sink = Collect(5)
            await t.stream([x.key for x in segs], "default", sink)
            assert not sink.dropped and sink.bufs == [bytearray(raw(x)) for x in segs]
            for x in segs:
                g = await t.get(x.key, out=torch.empty_like(x.payload))
                assert g is not None and torch.equal(g.payload, x.payload)
            assert t._stripes is not None and len(t._stripes.extra) == 2
            assert all(s.conn.tls is not None for s in t._stripes.extra)
            assert t.session_open and t.stats().errors == 0
        finally:
            await t.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(kill=True)


TOKEN = "alpha-token"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # a cpu tier of 10 MiB and no disk: an 8 MiB segment held by a send blocks the next put
    s = ServerProcess(args=["--cpu-bytes", "10MiB", "--disk-bytes", "0", "--tokens", f"{TOKEN}=a"])
    s.start()
    yield s
    s.stop(kill=True)


def data_port(server: ServerProcess) -> int:
    async def run() -> int:
        t = DataTier(target=server.target, token=TOKEN, shared_memory=False)
        try:
            assert await t.get(key(99)) is None  # opens the session
            assert t._session is not None
            return t._session.conn.sock.getpeername()[1]
        finally:
            await t.close()

    return asyncio.run(run())


def hello(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), 10)
    sock.sendall(pack(HELLO, 0, TOKEN.encode()))
    code, _, n = HEAD.unpack(sock.recv(HEAD.size, socket.MSG_WAITALL))
    assert code == OK and n == WELCOME.size
    assert WELCOME.unpack(sock.recv(n, socket.MSG_WAITALL))[1] == 2
    return sock


def store(server: ServerProcess, seg: KVSegment) -> bool:
    async def run() -> bool:
        t = DataTier(target=server.target, token=TOKEN, shared_memory=False)
        try:
            return await t.put(seg.key, seg)
        finally:
            await t.close()

    return asyncio.run(run())


def fetch(server: ServerProcess, k: bytes, delete: bool = False) -> KVSegment | None | bool:
    async def run() -> KVSegment | None | bool:
        t = DataTier(target=server.target, token=TOKEN, shared_memory=False)
        try:
            return await t.delete(k) if delete else await t.get(k)
        finally:
            await t.close()

    return asyncio.run(run())


BAD_PARTS = st.one_of(
    st.tuples(st.integers(0, 70), st.just(0)),  # no parts
    st.integers(1, 64).flatmap(lambda n: st.tuples(st.integers(n, n + 100), st.just(n))),
    st.tuples(st.integers(0, 64), st.integers(65, (1 << 32) - 1)),  # too many parts
)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(part_parts=BAD_PARTS, short=st.booleans())
def test_bad_parts_are_refused_and_change_nothing(server, part_parts, short) -> None:
    seg = segment(3, 4, 64)
    assert store(server, seg)
    body = key(3) + PART.pack(*part_parts)
    if short:  # a good part, but a body of the wrong length
        body = key(3) + PART.pack(0, 1)[:5]
    with hello(data_port(server)) as sock:
        sock.sendall(pack(GET_PART, 1, body))
        code, _, n = HEAD.unpack(sock.recv(HEAD.size, socket.MSG_WAITALL))
        assert code == BAD_REQUEST and b"GET_PART" in sock.recv(n, socket.MSG_WAITALL)
        assert sock.recv(1) == b""  # the session closed
    got = fetch(server, seg.key)
    assert isinstance(got, KVSegment) and torch.equal(got.payload, seg.payload)


READER = """
import socket, sys
from tierkv.cacheserver.dataplane.protocol import GET_PART, HEAD, HELLO, PART, WELCOME, pack
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])), 10)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
sock.sendall(pack(HELLO, 0, sys.argv[2].encode()))
sock.recv(HEAD.size + WELCOME.size, socket.MSG_WAITALL)
sock.sendall(pack(GET_PART, 1, bytes.fromhex(sys.argv[3]) + PART.pack(0, 2)))
print("asked", flush=True)
sys.stdin.read()  # never reads the reply: the server's sending thread stalls on a full socket
"""


def test_a_client_killed_mid_part_frees_the_pages_it_held(server) -> None:
    for k in range(8):
        fetch(server, key(k), delete=True)
    assert store(server, segment(0, 8, 2048, version=1))  # 8 MiB of the tier's 10
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(data_port(server)), TOKEN, key(0).hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "asked"
        time.sleep(0.5)  # the send is under way, stalled
        assert fetch(server, key(0), delete=True)
        # the deleted segment's pages are still being sent from: no room for another 8 MiB
        assert not store(server, segment(1, 8, 2048, version=2))
        reader.send_signal(signal.SIGKILL)
        reader.wait(10)
        deadline = time.monotonic() + 10
        while not store(server, segment(1, 8, 2048, version=3)):  # the pages come back
            assert time.monotonic() < deadline, "the killed client's pages were never freed"
            time.sleep(0.2)
    finally:
        reader.kill()
        reader.wait(10)
